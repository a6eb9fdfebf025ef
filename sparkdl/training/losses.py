"""Loss functions by name, and the label type each one needs."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from sparkdl.data.columns import LabelKind
from sparkdl.errors import ConfigError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _match_shape(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # A model with one output returns [n, 1] while a scalar label column is [n]:
    # same values, so view the target like the output rather than broadcast [n, n].
    if target.shape != output.shape and target.numel() == output.numel():
        return target.view_as(output)
    return target


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, _match_shape(output, target))


def _bce_with_logits(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(output, _match_shape(output, target))


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


NAMED_LOSSES: dict[str, tuple[LossFn, LabelKind]] = {
    "cross_entropy": (_cross_entropy, LabelKind.CLASS_INDEX),
    "mse": (_mse, LabelKind.REAL),
    "bce_with_logits": (_bce_with_logits, LabelKind.REAL),
}


def resolve_loss(loss: str | LossFn) -> tuple[LossFn, LabelKind]:
    """Return the loss callable and the label kind it expects.

    A callable ``loss(output, target) -> scalar mean loss`` gets float32 targets.
    """
    if callable(loss):
        return loss, LabelKind.REAL
    try:
        return NAMED_LOSSES[loss]
    except KeyError:
        raise ConfigError(
            f"loss_fn = {loss!r} is not a known loss; choose one of {', '.join(NAMED_LOSSES)} "
            "or pass a callable(output, target) returning the mean loss"
        ) from None
