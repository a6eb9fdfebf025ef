"""What a step is, between the loop and its strategy: the step handed over
(:class:`StepInput`), what it did (:class:`StepOutcome`, :class:`Verdict`), and what a
strategy did in an epoch (:class:`SyncStats`). Plain data, torch only."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from sparkdl.data.tensors import Batch


@dataclass(frozen=True)
class StepInput:
    """One step as the loop hands it to the strategy.

    Attributes:
        step: the global step index (0-based, counted across epochs).
        epoch: the 1-based epoch.
        batches: this worker's rows, as ``accumulate_steps`` micro-batches at most (their
            gradients add up before one optimizer step); empty once its partition has run out.
        rows: rows in ``batches`` (0 without any).
        global_rows: rows of this step over every worker.
        loss_of: runs the strategy's model and the loss on a batch: the mean loss.
        filler: a zero-weight batch, for a worker without rows whose strategy must
            still join the step's collectives.
        loss_fn: the loss ``loss_of`` calls, ``(output, target, weight) -> mean loss``, for a
            strategy whose model's output exists only on some worker (a pipeline's last stage).
    """

    step: int
    epoch: int
    batches: tuple[Batch, ...]
    rows: int
    global_rows: int
    loss_of: Callable[[nn.Module, Batch], torch.Tensor]
    filler: Callable[[], Batch]
    loss_fn: Callable[..., torch.Tensor] | None = None


class Verdict(enum.Enum):
    """What may happen to a step's gradients, as the precision and the NaN guard judge them."""

    APPLY = "apply"  # the optimizer steps
    OVERFLOW = "overflow"  # fp16: the scaled gradients overflowed; the scaler skipped the step
    NAN_SKIPPED = "nan_skipped"  # the NaN guard skipped the step (on_nan_loss = "skip")
    HELD = "held"  # not applied, not counted: this rank is stopping at the next sync


@dataclass(frozen=True)
class StepOutcome:
    """What one :meth:`SyncStrategy.train_step` did, for the loop to tally.

    Attributes:
        loss: this worker's mean loss on its rows (0 without rows, or when none of it was trained).
        trained: False when the rows went to no gradient (a backup worker catching up): the
            loop leaves them out of the epoch's loss and samples.
        nan_skipped: the NaN guard skipped this step's update (counted in ``nan_skips``).
    """

    loss: torch.Tensor
    trained: bool = True
    nan_skipped: bool = False


@dataclass
class SyncStats:
    """What a strategy did in one epoch."""

    sync_rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    pushes: int = 0
    pulls: int = 0
    staleness_mean: float = 0.0
    staleness_max: int = 0
    wait_s: float = 0.0
    skipped_steps: int = 0  # backup workers: steps this worker skipped to keep up (their rows untrained)
    dropped_pushes: int = 0  # ... and its pushes that came after their step was applied
    bytes_across_hosts: int = 0  # runtime.hierarchy: what this worker sent to other hosts
