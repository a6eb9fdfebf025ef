"""Per-step extras the loop calls in one place: reseeding, the fault drill, checkpoints,
progress reports. Torch only: progress leaves through a plain callable.

A hook sees the loop at three points: before a step, after a step, after an epoch.
The worker picks the hooks it needs when it is assembled; the loop runs them all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sparkdl.config import DrillKind, FaultDrillSpec
from sparkdl.training.checkpointing import Checkpointer, Position
from sparkdl.training.guards import fire_drill


@dataclass
class EpochTally:
    """The running figures of one worker's epoch."""

    epoch: int
    total_steps: int  # -1 while unknown (epoch 1 streams from Spark)
    started: float
    steps: int = 0
    samples: int = 0
    nan_skips: int = 0  # steps whose update the NaN guard skipped
    # rows-weighted, on the device: read (a device sync) only when reported
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))

    def loss_value(self) -> float:
        return float(self.loss_sum)


@dataclass(frozen=True)
class ProgressUpdate:
    """What a worker reports of its running epoch."""

    epoch: int
    steps: int
    total_steps: int
    samples: int
    loss_sum: float
    seconds: float
    val_loss: float | None = None  # the epoch's validation loss, once measured


class StepHook:
    """Does nothing by default; a hook overrides the points it needs."""

    def before_step(self, position: Position) -> None:
        """``position`` is where training stands before the step."""

    def after_step(self, position: Position, tally: EpochTally) -> None:
        """``position`` counts the step just taken."""

    def after_epoch(self, position: Position, tally: EpochTally, history: list[dict[str, Any]]) -> None:
        """``position`` is the start of the next epoch; ``history`` includes this one."""


class ReseedHook(StepHook):
    """The random stream of a step depends only on (seed, stream, step): a resumed run draws
    the same dropout masks as one that never failed. ``stream`` is the strategy's
    (``SyncStrategy.random_stream``): the rank, or one a tensor-parallel group shares."""

    def __init__(self, seed: int, stream: int) -> None:
        self._base = seed * 1_000_003 + stream * 7_919

    def before_step(self, position: Position) -> None:
        torch.manual_seed(self._base + position.global_steps_done)


class DrillHook(StepHook):
    """Fires the configured fault drill at its rank and step; a ``slow`` drill makes every
    step of its rank from that step on take three times as long (a straggler)."""

    SLOWDOWN = 3.0

    def __init__(self, drill: FaultDrillSpec, rank: int, module: nn.Module) -> None:
        self._drill = drill
        self._rank = rank
        self._module = module
        self._started: float | None = None

    def before_step(self, position: Position) -> None:
        if self._drill.kind is DrillKind.SLOW:
            slow = self._rank == self._drill.rank and position.global_steps_done >= self._drill.step
            self._started = time.perf_counter() if slow else None
            return
        fire_drill(self._drill, self._rank, position.global_steps_done, self._module)

    def after_step(self, position: Position, tally: EpochTally) -> None:
        if self._started is not None:
            time.sleep((self.SLOWDOWN - 1) * (time.perf_counter() - self._started))


class CheckpointHook(StepHook):
    """Rank 0 checkpoints every ``checkpoint_every`` steps and at epoch ends."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self._checkpointer = checkpointer

    def after_step(self, position: Position, tally: EpochTally) -> None:
        self._checkpointer.after_step(position)

    def after_epoch(self, position: Position, tally: EpochTally, history: list[dict[str, Any]]) -> None:
        self._checkpointer.history = history
        self._checkpointer.after_epoch(position)


class ProgressHook(StepHook):
    """Reports the running epoch through ``send`` whenever ``due()`` says so, and once at
    its end. The loss is read from the device only when a report goes out."""

    def __init__(
        self,
        send: Callable[[ProgressUpdate], None],
        due: Callable[[], bool],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._send = send
        self._due = due
        self._clock = clock

    def after_step(self, position: Position, tally: EpochTally) -> None:
        if self._due():
            self._report(tally, tally.total_steps)

    def after_epoch(self, position: Position, tally: EpochTally, history: list[dict[str, Any]]) -> None:
        self._report(tally, tally.steps, history[-1].get("val_loss") if history else None)

    def _report(self, tally: EpochTally, total: int, val_loss: float | None = None) -> None:
        seconds = self._clock() - tally.started
        self._send(
            ProgressUpdate(
                tally.epoch, tally.steps, total, tally.samples, tally.loss_value(), seconds, val_loss
            )
        )


class FirstStepHook(StepHook):
    """Times this worker's first step (where ``torch.compile``, ``training.compile``, compiles
    the model at its first forward and backward) and adds it to the history entry of the
    epoch it fell in, as ``compile_s``."""

    def __init__(self) -> None:
        self._started: float | None = None
        self.seconds: float | None = None
        self._reported = False

    def before_step(self, position: Position) -> None:
        if self.seconds is None and self._started is None:
            self._started = time.perf_counter()

    def after_step(self, position: Position, tally: EpochTally) -> None:
        if self.seconds is None and self._started is not None:
            self.seconds = time.perf_counter() - self._started

    def after_epoch(self, position: Position, tally: EpochTally, history: list[dict[str, Any]]) -> None:
        if self.seconds is not None and not self._reported and history:
            history[-1]["compile_s"] = self.seconds
            self._reported = True
