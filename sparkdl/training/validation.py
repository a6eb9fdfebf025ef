"""Validation after every epoch, and early stopping on its loss.

Every worker evaluates its own held-out rows with the bare module (no collective runs
inside the forward) and the sums are all-reduced over the control group, so every rank
gets the same figures and takes the same early-stopping decision. The strategy first
makes the workers' weights equal (a weight average, a pending push), so the figures are
those of one model. Pure torch: no Spark.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sparkdl.data.columns import LabelKind
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

    def evaluate(self, module: nn.Module) -> dict[str, float]:
        """The figures of ``module`` on every worker's held-out rows (all ranks call this)."""
        # [rows, loss x rows, correct or squared error, target values]
        sums = torch.zeros(4, dtype=torch.float64)
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                for batch in self._batches():
                    sums += self._measure(module, batch.to(self._device))
        finally:
            module.train(was_training)
        dist.all_reduce(sums, group=self._group)
        rows, loss_sum, score, values = sums.tolist()
        if rows == 0:
            return {}
        figures = {"val_loss": loss_sum / rows, "val_samples": int(rows)}
        if self._kind is LabelKind.CLASS_INDEX:
            figures["val_accuracy"] = score / rows
        else:
            figures["val_rmse"] = math.sqrt(score / max(values, 1.0))
        return figures

    def _measure(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        assert batch.label is not None
        output = call_model(module, batch, self._keyword).float()
        rows = len(batch)
        loss = float(self._loss_fn(output, batch.label, batch.weight))
        if self._kind is LabelKind.CLASS_INDEX:
            score = float((output.argmax(dim=-1) == batch.label).sum())
            values = float(rows)
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
    epoch's weights (a CPU copy, on rank 0 only: it is the rank that returns them)."""

    patience: int
    keep_weights: bool
    best_loss: float = math.inf
    best_epoch: int = 0
    epochs_without_gain: int = 0
    best_state: dict[str, torch.Tensor] | None = None

    def update(self, epoch: int, val_loss: float, module: nn.Module) -> bool:
        """Record ``epoch``'s loss; True when training should stop now."""
        if val_loss < self.best_loss:
            self.best_loss, self.best_epoch, self.epochs_without_gain = val_loss, epoch, 0
            if self.keep_weights:
                self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
            return False
        self.epochs_without_gain += 1
        return self.patience > 0 and self.epochs_without_gain >= self.patience

    def restore(self, module: nn.Module) -> bool:
        """Load the best epoch's weights into ``module``; False when it holds them already."""
        if self.best_state is None:
            return False
        module.load_state_dict(copy.copy(self.best_state))
        return True
