"""Validation after every epoch, and early stopping on its loss.

Every worker evaluates its own held-out rows with the bare module and the sums are
all-reduced over the control group, so every rank gets the same figures and takes the
same early-stopping decision. The strategy first makes the workers' weights equal (a
weight average, a pending push), so the figures are those of one model.

Where the forward itself is a collective (sharded parameters, strategy "fsdp"), the
ranks run their forwards in lockstep: before each one they agree whether any rank still
has a batch, and a rank that has none runs a filler forward whose output counts for
nothing. Otherwise no message passes per batch. Pure torch: no Spark.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sparkdl.data.columns import LabelKind
from sparkdl.data.inputs import IGNORED
from sparkdl.data.tensors import Batch, call_model
from sparkdl.training.losses import WeightedLoss


class Validator:
    """Measures ``val_loss`` and ``val_accuracy`` (class labels) or ``val_rmse`` (real
    targets) over every worker's held-out rows.

    Args:
        batches: this worker's held-out rows, a fresh iterator per call.
        loss_fn: the training loss (weighted when the rows carry weights).
        label_kind: class indices (accuracy) or real targets (rmse).
        keyword: the model takes its inputs by name.
        device: where the model lives.
        group: the control group the sums are all-reduced over.
    """

    def __init__(
        self,
        batches: Callable[[], Iterable[Batch]],
        loss_fn: WeightedLoss,
        label_kind: LabelKind,
        keyword: bool,
        device: torch.device,
        group: dist.ProcessGroup | None,
    ) -> None:
        self._batches = batches
        self._loss_fn = loss_fn
        self._kind = label_kind
        self._keyword = keyword
        self._device = device
        self._group = group

    def evaluate(
        self, module: nn.Module, lockstep_filler: Callable[[], Batch] | None = None
    ) -> dict[str, float]:
        """The figures of ``module`` on every worker's held-out rows (all ranks call this).

        Args:
            module: the model to measure.
            lockstep_filler: given when the forward is a collective: every rank then runs
                as many forwards as the rank with the most batches, on this batch (not
                measured) once its own have run out.
        """
        # [rows, loss x rows, correct or squared error, target values]
        sums = torch.zeros(4, dtype=torch.float64)
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                for batch, measured in self._rounds(lockstep_filler):
                    on_device = batch.to(self._device)
                    output = call_model(module, on_device, self._keyword)
                    if measured:
                        sums += self._measure(output, on_device)
        finally:
            module.train(was_training)
        dist.all_reduce(sums, group=self._group)
        rows, loss_sum, score, values = sums.tolist()
        if rows == 0:
            return {}
        figures = {"val_loss": loss_sum / rows, "val_samples": int(rows)}
        if self._kind is LabelKind.CLASS_INDEX:  # over the class ids: one per row or per position
            figures["val_accuracy"] = score / max(values, 1.0)
        else:
            figures["val_rmse"] = math.sqrt(score / max(values, 1.0))
        return figures

    def _rounds(self, lockstep_filler: Callable[[], Batch] | None) -> Iterator[tuple[Batch, bool]]:
        """This rank's batches (measured); in lockstep, then fillers (not measured) until
        no rank has a batch left, agreed by one small all-reduce before every forward."""
        if lockstep_filler is None:
            yield from ((batch, True) for batch in self._batches())
            return
        iterator = iter(self._batches())
        while True:
            batch = next(iterator, None)
            more = torch.tensor([0.0 if batch is None else 1.0], dtype=torch.float64)
            dist.all_reduce(more, op=dist.ReduceOp.MAX, group=self._group)
            if not more.item():
                return
            yield (batch, True) if batch is not None else (lockstep_filler(), False)

    def _measure(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        assert batch.label is not None
        output = output.float()
        rows = len(batch)
        loss = float(self._loss_fn(output, batch.label, batch.weight))
        if self._kind is LabelKind.CLASS_INDEX:  # positions without a target (IGNORED) not counted
            counted = batch.label != IGNORED
            score = float(((output.argmax(dim=-1) == batch.label) & counted).sum())
            values = float(counted.sum())
        else:
            target = (
                batch.label.float().reshape(output.shape)
                if batch.label.numel() == output.numel()
                else batch.label.float()
            )
            score = float(((output - target) ** 2).sum())
            values = float(target.numel())
        return torch.tensor([rows, loss * rows, score, values], dtype=torch.float64)


@dataclass
class EarlyStopping:
    """Stop after ``patience`` epochs without a lower validation loss; remember the best
    epoch's weights (the full state as a CPU copy, on rank 0 only: it is the rank that
    returns them). Every rank calls :meth:`update` and :meth:`restore` alike, because
    taking and setting a sharded model's full state are collectives; the validation loss
    is the same on every rank, so they take the same branches."""

    patience: int
    keep_weights: bool
    best_loss: float = math.inf
    best_epoch: int = 0
    epochs_without_gain: int = 0
    best_state: dict[str, torch.Tensor] | None = None

    def update(self, epoch: int, val_loss: float, full_state: Callable[[], dict[str, torch.Tensor]]) -> bool:
        """Record ``epoch``'s loss; True when training should stop now.

        Args:
            full_state: the model's full state as CPU tensors on rank 0, ``{}`` elsewhere
                (the strategy's ``full_state_dict``), called on a new best epoch.
        """
        if val_loss < self.best_loss:
            self.best_loss, self.best_epoch, self.epochs_without_gain = val_loss, epoch, 0
            state = full_state()
            if self.keep_weights:
                self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
            return False
        self.epochs_without_gain += 1
        return self.patience > 0 and self.epochs_without_gain >= self.patience

    def restore(self, load: Callable[[dict[str, torch.Tensor]], None]) -> bool:
        """Put the best epoch's weights back with ``load`` (the strategy's
        ``load_state_from_rank0``: rank 0 passes the state, the others ``{}``); False when
        no epoch was ever measured."""
        if self.best_epoch == 0:
            return False
        load(dict(self.best_state or {}))
        return True
