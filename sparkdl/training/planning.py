"""Step planning: every worker takes the same number of steps in an epoch.

Uneven and empty partitions. Every collective must be matched, so every worker takes
the same number of steps. A worker whose partition has run out keeps stepping on a
*filler* batch (rows it saw before, or zeros if it never had any) whose loss weight is
0, so it adds nothing to the gradient.

How a worker learns the step's global row count: in epoch 1 (data still streaming from
Spark, partition sizes unknown) one small all-reduce per step over the CPU control group
shares each worker's rows (:class:`StepControl`, :class:`StreamingCoordinator`); from
epoch 2 on the sizes are known, exchanged once (:func:`exchange_row_counts`), and the
schedule is a pure function of them (:class:`ScheduledCoordinator`, no per-step messages).

One loop of control. :func:`planned_steps` is the one place an epoch's steps are agreed:
the next micro-batches, the coordinator's plan for them, a rejected input stopping every
rank at the same step, the end of the epoch. The Estimator's loop and ``ctx.batches`` of a
user's own loop both walk it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from sparkdl.data.batching import global_batch_rows, steps_in_epoch
from sparkdl.data.tensors import Batch
from sparkdl.errors import BadDataError, PeerStopped, SchemaError, SparkDLError, agreed

#: Sums a small CPU tensor over every worker, in place (the exchange's ``sum_control_``).
Sum = Callable[[torch.Tensor], object]


@dataclass(frozen=True)
class StepPlan:
    """What every worker agreed on for one step."""

    global_rows: int


class InputRejected(Exception):
    """Some worker rejected its input this step (raised on every worker alike)."""


@dataclass(frozen=True)
class StepControl:
    """One worker's contribution to a streaming step's all-reduce, and the summed result."""

    rows: float
    holders: float
    failures: float

    @classmethod
    def local(cls, rows: int, failed: bool) -> StepControl:
        return cls(rows, 1.0 if rows else 0.0, float(failed))

    def summed(self, sum_: Sum) -> StepControl:
        vector = torch.tensor([self.rows, self.holders, self.failures], dtype=torch.float64)
        sum_(vector)
        return StepControl(*vector.tolist())

    def plan(self) -> StepPlan | None:
        return StepPlan(int(self.rows)) if self.holders else None


class StepCoordinator(abc.ABC):
    """Decides, identically on every worker, whether another step happens."""

    @abc.abstractmethod
    def next_step(self, rows: int, failed: bool = False) -> StepPlan | None:
        """Plan the next step, or None when every worker has run out of rows.

        ``failed`` says this worker rejected its input; then every worker raises
        :class:`InputRejected` together, so the stage ends without a task failure (and
        without Spark re-running a stage that would fail the same way again).
        """

    @property
    @abc.abstractmethod
    def streaming(self) -> bool:
        """Whether data still streams from Spark (input may be rejected mid-epoch)."""

    def skip(self) -> None:  # noqa: B027 - only a schedule has state to advance
        """A step done before a failure is skipped on resume (no messages)."""

    @property
    def total_steps(self) -> int:
        """Steps in the epoch, or -1 while unknown (data still streaming)."""
        return -1


class StreamingCoordinator(StepCoordinator):
    """Epoch 1: one small all-reduce per step (of three numbers, on the CPU)."""

    streaming = True

    def __init__(self, sum_: Sum) -> None:
        self._sum = sum_

    def next_step(self, rows: int, failed: bool = False) -> StepPlan | None:
        agreed = StepControl.local(rows, failed).summed(self._sum)
        if agreed.failures:
            raise InputRejected()
        return agreed.plan()


class ScheduledCoordinator(StepCoordinator):
    """Epochs 2+: every worker's row count is known, so the plan needs no messages."""

    streaming = False

    def __init__(self, counts: Sequence[int], batch_size: int) -> None:
        self._counts = list(counts)
        self._batch_size = batch_size
        self._steps = steps_in_epoch(self._counts, batch_size)
        self._step = 0

    def skip(self) -> None:
        self._step += 1

    @property
    def total_steps(self) -> int:
        return self._steps

    def next_step(self, rows: int, failed: bool = False) -> StepPlan | None:
        if self._step >= self._steps:
            return None
        global_rows = global_batch_rows(self._counts, self._batch_size, self._step)
        self._step += 1
        return StepPlan(global_rows)


def exchange_row_counts(rank: int, world_size: int, rows: int, sum_: Sum) -> list[int]:
    """Every worker's row count, in rank order, in one all-reduce."""
    vector = torch.zeros(world_size, dtype=torch.float64)
    vector[rank] = rows
    sum_(vector)
    return [int(c) for c in vector.tolist()]


def coordinator_for(streaming: bool, counts: list[int] | None, batch_size: int, sum_: Sum) -> StepCoordinator:
    """The coordinator of an epoch: streaming while the data comes from Spark, else the schedule."""
    if streaming or counts is None:
        return StreamingCoordinator(sum_)
    return ScheduledCoordinator(counts, batch_size)


class Filler:
    """The zero-weight batch a worker steps on once its own rows have run out: two rows
    it saw before, or, for a worker that never had any, the template (two rows the driver
    decoded from the DataFrame: the same inputs, dtypes and row shapes)."""

    def __init__(self, template: Batch | None) -> None:
        self._batch = template
        self._remembered = False

    def remember(self, batch: Batch) -> None:
        if not self._remembered and len(batch) > 0:
            self._batch = batch.head(2)
            self._remembered = True

    @property
    def available(self) -> bool:
        """Whether :meth:`batch` has a batch to give."""
        return self._batch is not None

    def batch(self) -> Batch:
        if self._batch is None:
            raise RuntimeError(
                "this worker holds no rows and has no template batch to step on; fit found no row "
                "on the driver either (is the DataFrame empty?)"
            )
        return self._batch


@dataclass(frozen=True)
class PlannedStep:
    """One step of an epoch as every worker agreed on it.

    Attributes:
        batches: this worker's micro-batches (none once its rows ran out).
        rows: rows in ``batches``.
        plan: the step's agreed plan; None for a step trained before the checkpoint the run
            resumed from, whose batches are only consumed.
    """

    batches: tuple[Batch, ...]
    rows: int
    plan: StepPlan | None


#: This worker's next micro-batches (none once its rows ran out) and, while streaming, the
#: error of an input it rejects (returned, not raised, so that every rank stops together).
Take = Callable[[], tuple[tuple[Batch, ...], SparkDLError | None]]


def planned_steps(
    take: Take, coordinator: StepCoordinator, rank: int, skip: int = 0
) -> Iterator[PlannedStep]:
    """An epoch's steps, agreed with every other worker: each step's micro-batches from
    ``take``, planned by ``coordinator`` (every rank asks it at every step, rows or none),
    until it says the epoch is over. The first ``skip`` steps (trained before a failure,
    restored from a checkpoint) only consume their batches.

    Raises:
        SparkDLError: some worker rejected its input: this worker's own error, or
            :class:`~sparkdl.errors.PeerStopped` naming it; agreed, every rank at the same step.
    """
    for _ in range(skip):
        batches, _rejected = take()
        coordinator.skip()
        yield PlannedStep(batches, 0, None)
    while True:
        batches, rejected = take()
        rows = sum(len(batch) for batch in batches)
        try:
            plan = coordinator.next_step(rows, rejected is not None)
        except InputRejected:
            stopped = PeerStopped(f"rank {rank} stopped because another worker rejected its input")
            raise agreed(rejected or stopped) from rejected
        if plan is None:
            return
        yield PlannedStep(batches, rows, plan)


def next_batch(iterator: Iterator[Batch], streaming: bool) -> tuple[Batch | None, SparkDLError | None]:
    """The next batch (None at the end); while streaming, a rejected input is returned, not
    raised, so that every rank can stop together at the step's control sum."""
    try:
        return next(iterator, None), None
    except (BadDataError, SchemaError) as exc:
        if not streaming:
            raise
        return None, exc
