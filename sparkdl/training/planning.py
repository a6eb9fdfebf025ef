"""Step planning: every worker takes the same number of steps in an epoch.

Uneven and empty partitions. Every collective must be matched, so every worker takes
the same number of steps. A worker whose partition has run out keeps stepping on a
*filler* batch (rows it saw before, or zeros if it never had any) whose loss weight is
0, so it adds nothing to the gradient.

How a worker learns the step's global row count: in epoch 1 (data still streaming from
Spark, partition sizes unknown) one small all-reduce per step over the CPU control group
shares each worker's rows (:class:`StreamingCoordinator`); from epoch 2 on the sizes are
known, exchanged once (:func:`exchange_partition_info`), and the schedule is a pure
function of them (:class:`ScheduledCoordinator`, no per-step messages).

The control messages are named types (:class:`StepControl`, :class:`PartitionMessage`):
their layout as a flat float64 vector lives in one place each.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparkdl.data.batching import global_batch_rows, steps_in_epoch
from sparkdl.data.columns import LabelKind

TensorBatch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StepPlan:
    """What every worker agreed on for one step."""

    global_rows: int
    x_width: int = 0
    y_width: int = 0


@dataclass(frozen=True)
class BatchShape:
    """What one worker holds for the next step: its rows and their widths."""

    rows: int
    x_width: int
    y_width: int

    @classmethod
    def of(cls, batch: TensorBatch | None) -> BatchShape:
        if batch is None:
            return cls(0, 0, 1)
        x, y = batch
        return cls(len(x), x.shape[1] if x.dim() > 1 else 0, y.shape[1] if y.dim() > 1 else 1)


class InputRejected(Exception):
    """Some worker rejected its input this step (raised on every worker alike)."""


@dataclass(frozen=True)
class StepControl:
    """One worker's contribution to a streaming step's all-reduce, and the summed result.

    Widths are summed only over workers that hold rows (``holders``), so the agreed
    width is their mean: every holder has the same width, so it is exact.
    """

    rows: float
    holders: float
    x_width_sum: float
    y_width_sum: float
    failures: float

    @classmethod
    def local(cls, shape: BatchShape, failed: bool) -> StepControl:
        has = 1.0 if shape.rows else 0.0
        return cls(shape.rows, has, shape.x_width * has, shape.y_width * has, float(failed))

    def all_reduce(self, group: dist.ProcessGroup | None) -> StepControl:
        vector = torch.tensor(
            [self.rows, self.holders, self.x_width_sum, self.y_width_sum, self.failures], dtype=torch.float64
        )
        dist.all_reduce(vector, group=group)
        return StepControl(*vector.tolist())

    def plan(self) -> StepPlan | None:
        if self.holders == 0:
            return None
        return StepPlan(
            int(self.rows), round(self.x_width_sum / self.holders), round(self.y_width_sum / self.holders)
        )


class StepCoordinator(abc.ABC):
    """Decides, identically on every worker, whether another step happens."""

    @abc.abstractmethod
    def next_step(self, shape: BatchShape, failed: bool = False) -> StepPlan | None:
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
    """Epoch 1: one small all-reduce per step over the (gloo, CPU) control group."""

    streaming = True

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self._group = group

    def next_step(self, shape: BatchShape, failed: bool = False) -> StepPlan | None:
        agreed = StepControl.local(shape, failed).all_reduce(self._group)
        if agreed.failures:
            raise InputRejected()
        return agreed.plan()


class ScheduledCoordinator(StepCoordinator):
    """Epochs 2+: every worker's row count is known, so the plan needs no messages."""

    streaming = False

    def __init__(self, counts: Sequence[int], batch_size: int, widths: tuple[int, int]) -> None:
        self._counts = list(counts)
        self._batch_size = batch_size
        self._widths = widths
        self._steps = steps_in_epoch(self._counts, batch_size)
        self._step = 0

    def skip(self) -> None:
        self._step += 1

    @property
    def total_steps(self) -> int:
        return self._steps

    def next_step(self, shape: BatchShape, failed: bool = False) -> StepPlan | None:
        if self._step >= self._steps:
            return None
        rows = global_batch_rows(self._counts, self._batch_size, self._step)
        self._step += 1
        return StepPlan(rows, *self._widths)


@dataclass(frozen=True)
class PartitionInfo:
    """What every worker knows about all partitions once they have been read."""

    counts: list[int]  # rows per worker, in rank order
    widths: tuple[int, int]  # agreed feature and label widths (for workers without rows)

    @property
    def total_rows(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class PartitionMessage:
    """Layout of the one all-reduce that shares every worker's row count and widths:
    ``[rows of rank 0 .. rows of rank N-1, x width sum, y width sum, holders]``."""

    world_size: int

    def pack(self, rank: int, rows: int, widths: tuple[int, int]) -> torch.Tensor:
        has = 1.0 if rows else 0.0
        vector = torch.zeros(self.world_size + 3, dtype=torch.float64)
        vector[rank] = rows
        vector[self.world_size :] = torch.tensor([widths[0] * has, widths[1] * has, has])
        return vector

    def unpack(self, vector: torch.Tensor) -> PartitionInfo:
        values = vector.tolist()
        x_sum, y_sum, holders = values[self.world_size :]
        widths = (round(x_sum / holders), round(y_sum / holders)) if holders else (0, 1)
        return PartitionInfo([int(c) for c in values[: self.world_size]], widths)


def exchange_partition_info(
    rank: int, world_size: int, rows: int, widths: tuple[int, int], group: dist.ProcessGroup | None
) -> PartitionInfo:
    """Every worker's row count and the agreed widths, in one all-reduce."""
    message = PartitionMessage(world_size)
    vector = message.pack(rank, rows, widths)
    dist.all_reduce(vector, group=group)
    return message.unpack(vector)


def coordinator_for(
    streaming: bool, partitions: PartitionInfo | None, batch_size: int, group: dist.ProcessGroup | None
) -> StepCoordinator:
    """The coordinator of an epoch: streaming while the data comes from Spark, else the schedule."""
    if streaming or partitions is None:
        return StreamingCoordinator(group)
    return ScheduledCoordinator(partitions.counts, batch_size, partitions.widths)


class Filler:
    """The zero-weight batch a worker steps on once its own rows have run out."""

    def __init__(self, label_kind: LabelKind) -> None:
        self._label_kind = label_kind
        self._batch: TensorBatch | None = None

    def remember(self, batch: TensorBatch) -> None:
        if self._batch is None and len(batch[0]) > 0:
            self._batch = (batch[0][:2].clone(), batch[1][:2].clone())

    def batch(self, plan: StepPlan) -> TensorBatch:
        if self._batch is not None:
            return self._batch
        x = torch.zeros(2, plan.x_width)
        if self._label_kind is LabelKind.CLASS_INDEX:
            return x, torch.zeros(2, dtype=torch.int64)
        y = torch.zeros(2, plan.y_width) if plan.y_width > 1 else torch.zeros(2)
        return x, y
