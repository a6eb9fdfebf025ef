"""Loss functions by name, the label type each one needs, and per-row weights.

Every loss the loop calls has the form ``loss(output, target, weight)`` and returns the
mean over the batch's rows; with a weight column it is the mean of ``weight x row loss``
(so the workers' step math, which weighs each worker by its rows, stays exact).

``cross_entropy`` also takes a class id per position: a label of shape ``(N, T)`` (an
``array<int>`` column of T ids per row: the next token of a language model, a tag per token)
with logits ``(N, T, C)``, the classes last as language models return them. A row's loss is
the mean over its positions, so every row of the same length weighs the same.

``causal_lm`` trains a language model on a sequence input without a label column: each
position's target is the next token of the same row (:func:`sparkdl.data.tensors.to_batch`
makes them), padding and each row's last position left out.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sparkdl.data.columns import LabelKind
from sparkdl.data.inputs import IGNORED
from sparkdl.errors import ConfigError

#: A user's loss: ``loss(output, target) -> mean loss``, or with ``weight`` as a third argument.
LossFn = Callable[..., torch.Tensor]
#: The form the loop calls: ``loss(output, target, weight or None) -> mean loss``.
WeightedLoss = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _match_shape(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # A model with one output returns [n, 1] while a scalar label column is [n]:
    # same values, so view the target like the output rather than broadcast [n, n].
    if target.shape != output.shape and target.numel() == output.numel():
        return target.view_as(output)
    return target


def _reduce(per_element: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    if weight is None:
        return per_element.mean()
    per_row = per_element.reshape(len(per_element), -1).mean(dim=1)
    return (per_row * weight.to(per_row.dtype)).mean()


def _mse(output: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    return _reduce(F.mse_loss(output, _match_shape(output, target), reduction="none"), weight)


def _bce_with_logits(
    output: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    per_element = F.binary_cross_entropy_with_logits(output, _match_shape(output, target), reduction="none")
    return _reduce(per_element, weight)


def _cross_entropy(
    output: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    if target.dim() > 1:  # a class id per position: the logits have the classes last
        output = output.movedim(-1, 1)
    return _reduce(F.cross_entropy(output, target, reduction="none"), weight)


def causal_lm_row_losses(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next-token cross-entropy, the mean over its positions that have a next
    token (logits ``(N, T, V)``, ``target`` ``(N, T)``, :data:`IGNORED` where there is none; a
    row with none: 0), and how many positions each row counted."""
    per_position = F.cross_entropy(output.movedim(-1, 1), target, ignore_index=IGNORED, reduction="none")
    counted = (target != IGNORED).sum(dim=1)
    return per_position.sum(dim=1) / counted.clamp(min=1), counted


def _causal_lm(
    output: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Next-token cross-entropy (:func:`causal_lm_row_losses`): rows of any length weigh the
    same; the mean over rows, weighted like the other losses."""
    per_row, _ = causal_lm_row_losses(output, target)
    return per_row.mean() if weight is None else (per_row * weight.to(per_row.dtype)).mean()


NAMED_LOSSES: dict[str, tuple[WeightedLoss, LabelKind]] = {
    "cross_entropy": (_cross_entropy, LabelKind.CLASS_INDEX),
    "causal_lm": (_causal_lm, LabelKind.CLASS_INDEX),
    "mse": (_mse, LabelKind.REAL),
    "bce_with_logits": (_bce_with_logits, LabelKind.REAL),
}


def resolve_loss(loss: str | LossFn) -> tuple[WeightedLoss, LabelKind]:
    """Return the loss in the loop's form ``(output, target, weight)`` and the label kind
    it expects. A callable ``loss(output, target)`` gets float32 targets; one that also
    takes ``weight`` gets the per-row weights (None without a weight column).
    """
    if callable(loss):
        return _user_loss(loss), LabelKind.REAL
    try:
        return NAMED_LOSSES[loss]
    except KeyError:
        raise ConfigError(
            f"loss_fn = {loss!r} is not a known loss; choose one of {', '.join(NAMED_LOSSES)} "
            "or pass a callable(output, target) returning the mean loss"
        ) from None


def takes_weight(loss: str | LossFn) -> bool:
    """Whether ``loss`` can weigh rows (every named loss can; a callable that takes ``weight``)."""
    if isinstance(loss, str):
        return True
    try:
        return "weight" in inspect.signature(loss).parameters
    except (TypeError, ValueError):
        return False


def _user_loss(fn: LossFn) -> WeightedLoss:
    weighted = takes_weight(fn)

    def loss(output: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if weighted:
            return fn(output, target, weight=weight)
        if weight is not None:
            raise ConfigError(
                "weight_col is set but loss_fn takes no weight; give it a third parameter "
                "`weight` (per-row weights, or None) or unset weight_col"
            )
        return fn(output, target)

    loss.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)
    return loss
