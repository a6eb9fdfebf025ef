"""Blocks of numpy rows -> :class:`Batch` of tensors, and the call of the model on one.

Sequences are padded here, per batch, to the batch's longest row (so a batch of short
rows stays short; or every batch to ``max_sequence_length`` with ``pad_to_max_length``), with
a text input's padding id (0 for others) and a boolean mask (``<name>_mask``, or as ``data.mask_input`` names
it); images become float32 in [0, 1].
Arrays that own their memory become tensors without a copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from sparkdl.data.blocks import Block, Ragged
from sparkdl.data.inputs import IGNORED, DataPlan
from sparkdl.errors import SchemaError


@dataclass(slots=True)  # built per batch: slots, not frozen, keep construction cheap
class Batch:
    """One step's rows as tensors.

    Attributes:
        inputs: input name -> tensor ``[rows, ...]`` (masks of sequences included).
        label: the targets, or None (inference).
        weight: float32 ``[rows]`` loss weights, or None (every row weighs 1).
    """

    inputs: dict[str, torch.Tensor]
    label: torch.Tensor | None = None
    weight: torch.Tensor | None = None

    def __len__(self) -> int:
        first = self.label if self.label is not None else next(iter(self.inputs.values()))
        return len(first)

    def to(self, device: torch.device) -> Batch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(
            {k: v.to(device, non_blocking=True) for k, v in self.inputs.items()},
            move(self.label),
            move(self.weight),
        )

    def head(self, rows: int) -> Batch:
        """A copy of the first ``rows`` rows (owning its memory)."""
        cut = lambda t: None if t is None else t[:rows].clone()  # noqa: E731
        return Batch({k: v[:rows].clone() for k, v in self.inputs.items()}, cut(self.label), cut(self.weight))

    def pin_memory(self) -> Batch:
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return Batch({k: v.pin_memory() for k, v in self.inputs.items()}, pin(self.label), pin(self.weight))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """One row's shape per input (what the model saw)."""
        return {name: tuple(t.shape[1:]) for name, t in self.inputs.items()}


def join_batches(batches: Sequence[Batch]) -> Batch:
    """One batch of the rows of ``batches``, in order (the first itself when it is alone)."""
    if len(batches) == 1:
        return batches[0]
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    return Batch(
        {name: torch.cat([b.inputs[name] for b in batches]) for name in batches[0].inputs},
        cat([b.label for b in batches]),
        cat([b.weight for b in batches]),
    )


def call_model(model: nn.Module, batch: Batch, keyword: bool) -> torch.Tensor:
    """``model(**inputs)``; one input (feature_cols' matrix, or a single named input) is
    passed positionally, ``model(x)``, so that ``nn.Sequential`` and the like take it. The
    output is :func:`model_output`'s: a Hugging Face model's logits."""
    if keyword and len(batch.inputs) > 1:
        return model_output(model(**batch.inputs))
    (x,) = batch.inputs.values()
    return model_output(model(x))


def model_output(output: Any) -> Any:
    """What the loss and ``transform`` read of a model's output: a tensor as it is, the
    ``logits`` of a Hugging Face ``ModelOutput`` (or of any mapping or object that has them:
    a classifier's ``(N, C)``, a language model's ``(N, T, V)``), anything else unchanged
    (the preflight then says what it expected)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else output


def to_batch(block: Block, plan: DataPlan, pin_memory: bool = False) -> Batch:
    """The tensors of a block: sequences padded with their masks, images scaled."""
    images = plan.image_inputs
    inputs: dict[str, torch.Tensor] = {}
    for name, column in block.inputs.items():
        if isinstance(column, Ragged):
            values, mask = column.padded(
                plan.max_sequence_length, plan.pad_ids.get(name, 0), fixed=plan.pad_to_max_length
            )
            inputs[name] = torch.from_numpy(values)
            inputs[plan.mask_name(name)] = torch.from_numpy(mask)
        elif name in images:
            inputs[name] = torch.from_numpy(_owned(column)).float().div_(255.0)
        else:
            inputs[name] = torch.from_numpy(_owned(column))
    label = None if block.label is None else torch.from_numpy(_owned(block.label))
    if plan.next_token_of:
        label = next_tokens(inputs[plan.next_token_of], inputs.get(plan.mask_name(plan.next_token_of)))
    weight = None if block.weight is None else torch.from_numpy(_owned(block.weight))
    batch = Batch(inputs, label, weight)
    return batch.pin_memory() if pin_memory else batch


def next_tokens(ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A causal language model's targets: each position's next token of the same row,
    :data:`~sparkdl.data.inputs.IGNORED` where there is none (padding, a row's last token).

    Raises:
        SchemaError: the ids are not integers.
    """
    if ids.is_floating_point() or ids.dim() != 2:
        raise SchemaError(
            f"loss_fn = 'causal_lm' needs token ids, integers of shape (rows, positions); the input "
            f"is {ids.dtype} of shape {tuple(ids.shape)}: cast the column to array<int>"
        )
    targets = torch.full_like(ids, IGNORED, dtype=torch.int64)
    following = ids[:, 1:].long()
    if mask is not None:
        following = following.masked_fill(~mask[:, 1:], IGNORED)
    targets[:, :-1] = following
    return targets


def _owned(array: np.ndarray) -> np.ndarray:
    """``array`` if torch may wrap it (writeable, e.g. decoded or gathered), else a copy
    (a zero-copy view of Arrow memory or of the read-only cache map)."""
    return array if array.flags.writeable else np.array(array)
