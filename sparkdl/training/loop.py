"""The per-worker training loop: torch and torch.distributed only, no Spark.

Uneven and empty partitions. Every worker takes the same number of steps in an
epoch, so every collective is matched and nothing hangs. A worker whose partition
has run out keeps stepping on a *filler* batch (rows it saw before, or zeros if it
never had any) whose loss is multiplied by 0, so it adds nothing to the gradient.
Each worker scales its mean loss by ``world * local_rows / global_rows``; after
DDP's mean over workers the gradient is exactly the mean over all rows of the
step, as single-process SGD on the union of the workers' batches would compute.
Every worker then applies the same averaged gradient, so weights and optimizer
state stay identical on all ranks.

How a worker learns ``global_rows``: in epoch 1 (data still streaming from Spark,
partition sizes unknown) a tiny all-reduce per step shares each worker's row
count; from epoch 2 on the sizes are known, exchanged once, and the schedule is a
pure function of them (no per-step control traffic).
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from sparkdl.data.batching import global_batch_rows, steps_in_epoch
from sparkdl.data.columns import LabelKind
from sparkdl.errors import BadDataError, PeerStopped, SchemaError, SparkDLError, agreed
from sparkdl.progress.board import Report
from sparkdl.progress.channel import ProgressReporter
from sparkdl.strategies.base import SyncStats, SyncStrategy, WorkerContext
from sparkdl.training.checkpointing import Checkpointer, Position
from sparkdl.training.guards import FaultDrill, NanGuard
from sparkdl.training.losses import LossFn

log = logging.getLogger(__name__)

TensorBatch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StepPlan:
    """What every worker agreed on for one step."""

    global_rows: int
    x_width: int = 0
    y_width: int = 0


class _InputRejected(Exception):
    """Some worker rejected its input this step (raised on every worker alike)."""


class StepCoordinator(abc.ABC):
    """Decides, identically on every worker, whether another step happens."""

    @abc.abstractmethod
    def next_step(self, local_rows: int, x_width: int, y_width: int, failed: bool = False) -> StepPlan | None:
        """Plan the next step, or None when every worker has run out of rows.

        ``failed`` says this worker rejected its input; then every worker raises
        ``_InputRejected`` together, so the stage ends without a task failure (and
        without Spark re-running a stage that would fail the same way again).
        """

    def skip(self) -> None:  # noqa: B027 - only a schedule has state to advance
        """A step done before a failure is skipped on resume (no messages)."""

    @property
    def total_steps(self) -> int:
        """Steps in the epoch, or -1 while unknown (data still streaming)."""
        return -1


class StreamingCoordinator(StepCoordinator):
    """Epoch 1: one small all-reduce per step over the (gloo, CPU) control group."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self._group = group

    def next_step(self, local_rows: int, x_width: int, y_width: int, failed: bool = False) -> StepPlan | None:
        has = 1.0 if local_rows else 0.0
        control = torch.tensor(
            [local_rows, has, x_width * has, y_width * has, float(failed)], dtype=torch.float64
        )
        dist.all_reduce(control, group=self._group)
        rows, active, x_sum, y_sum, failures = control.tolist()
        if failures:
            raise _InputRejected()
        if active == 0:
            return None
        return StepPlan(int(rows), round(x_sum / active), round(y_sum / active))


class ScheduledCoordinator(StepCoordinator):
    """Epochs 2+: every worker's row count is known, so the plan needs no messages."""

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

    def next_step(self, local_rows: int, x_width: int, y_width: int, failed: bool = False) -> StepPlan | None:
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


def exchange_partition_info(
    local_rows: int, widths: tuple[int, int], ctx: WorkerContext, group: dist.ProcessGroup | None
) -> PartitionInfo:
    """Every worker's row count and the agreed widths, in one all-reduce."""
    has = 1.0 if local_rows else 0.0
    message = torch.zeros(ctx.world_size + 3, dtype=torch.float64)
    message[ctx.rank] = local_rows
    message[ctx.world_size :] = torch.tensor([widths[0] * has, widths[1] * has, has])
    dist.all_reduce(message, group=group)
    values = message.tolist()
    x_sum, y_sum, holders = values[ctx.world_size :]
    agreed = (round(x_sum / holders), round(y_sum / holders)) if holders else (0, 1)
    return PartitionInfo([int(c) for c in values[: ctx.world_size]], agreed)


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


@dataclass
class EpochResult:
    """One worker's view of one epoch; ``loss`` and ``samples`` are global."""

    epoch: int
    loss: float
    samples: int
    local_samples: int
    steps: int
    seconds: float
    source: str
    sync: SyncStats = field(default_factory=SyncStats)
    nan_skips: int = 0


class Trainer:
    """Runs epochs on one worker.

    Args:
        module: the wrapped module to run forward/backward on (e.g. DDP).
        optimizer: the optimizer over the module's parameters.
        loss_fn: ``loss(output, target)`` returning the mean loss of the batch.
        label_kind: whether labels are class indices (checked against the output width).
        strategy: the sync strategy already set up on ``module``.
        ctx: rank, world size and device.
        control_group: gloo group for the small CPU messages of the loop.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        label_kind: LabelKind,
        strategy: SyncStrategy,
        ctx: WorkerContext,
        control_group: dist.ProcessGroup | None,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.label_kind = label_kind
        self.strategy = strategy
        self.ctx = ctx
        self.control_group = control_group
        self.filler = Filler(label_kind)
        self.output_shape: tuple[int, ...] | None = None
        self.input_shape: tuple[int, ...] | None = None
        self.global_step = 0  # steps done since the start of training (set on resume)
        self.guard: NanGuard | None = None
        self.drill: FaultDrill | None = None
        self.checkpointer: Checkpointer | None = None
        self.reseed: int | None = None
        self.reporter: ProgressReporter | None = None
        self._classes: int | None = None  # outputs of the model, for the label check

    def run_epoch(
        self,
        epoch: int,
        batches: Iterable[TensorBatch],
        coordinator: StepCoordinator,
        source: str,
        final: bool = False,
        skip_steps: int = 0,
    ) -> EpochResult:
        """Train one epoch; every worker must call this with matching arguments.

        ``final`` marks the last epoch: the strategy then makes every worker's
        weights equal (e.g. a last weight average) before the epoch's figures close.
        ``skip_steps`` steps (done before a failure, restored from a checkpoint) only
        consume their batches.
        """
        started = time.perf_counter()
        skips_before = self.guard.skipped if self.guard else 0
        self.module.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        local_samples = steps = 0
        iterator = iter(batches)
        validate = source == "spark"
        while True:
            batch, rejected = self._next_batch(iterator, coordinator)
            if batch is not None:
                self.filler.remember(batch)
            if steps < skip_steps:
                coordinator.skip()
                steps += 1
                continue
            if validate and rejected is None and batch is not None:
                rejected = self._check_labels(batch)
            rows = len(batch[0]) if batch is not None else 0
            x_width = batch[0].shape[1] if batch is not None and batch[0].dim() > 1 else 0
            y_width = batch[1].shape[1] if batch is not None and batch[1].dim() > 1 else 1
            try:
                plan = coordinator.next_step(rows, x_width, y_width, rejected is not None)
            except _InputRejected:
                raise self._agreed_stop(rejected) from rejected
            if plan is None:
                break
            steps += 1
            self._before_step()
            if batch is None and not self.strategy.steps_without_data:
                self.strategy.after_step(self.global_step, 0)
                self.global_step += 1
            else:
                loss = self._step(batch if batch is not None else self.filler.batch(plan), rows, plan, epoch)
                loss_sum += loss.detach().double() * rows
                local_samples += rows
            if self.checkpointer is not None:
                self.checkpointer.after_step(Position(epoch, steps, self.global_step))
            if self.reporter is not None:
                self._report(epoch, steps, coordinator, local_samples, loss_sum, started)
        if self.reporter is not None:
            self._report(epoch, steps, coordinator, local_samples, loss_sum, started, final=True)
        if final:
            self.strategy.finish()
        if next(iterator, None) is not None:
            raise RuntimeError(
                f"rank {self.ctx.rank}: the step schedule ended before this worker's data did; "
                "this is a sparkdl bug, please report it"
            )
        totals = torch.tensor([loss_sum.item(), float(local_samples)], dtype=torch.float64)
        dist.all_reduce(totals, group=self.control_group)
        global_loss, global_samples = totals.tolist()
        return EpochResult(
            epoch=epoch,
            loss=global_loss / max(global_samples, 1.0),
            samples=int(global_samples),
            local_samples=local_samples,
            steps=steps,
            seconds=time.perf_counter() - started,
            source=source,
            sync=self.strategy.end_epoch(),
            nan_skips=(self.guard.skipped if self.guard else 0) - skips_before,
        )

    def _report(
        self,
        epoch: int,
        steps: int,
        coordinator: StepCoordinator,
        samples: int,
        loss_sum: torch.Tensor,
        started: float,
        final: bool = False,
    ) -> None:
        assert self.reporter is not None
        if final or self.reporter.due():
            total = steps if final else coordinator.total_steps
            elapsed = time.perf_counter() - started
            report = Report(
                self.ctx.rank, epoch, self.reporter.attempt, steps, total, samples, float(loss_sum), elapsed
            )
            self.reporter.send(report)

    def _next_batch(
        self, iterator: Iterator[TensorBatch], coordinator: StepCoordinator
    ) -> tuple[TensorBatch | None, SparkDLError | None]:
        """The next batch; while streaming, a rejected input is reported, not raised."""
        try:
            return next(iterator, None), None
        except (BadDataError, SchemaError) as exc:
            if not isinstance(coordinator, StreamingCoordinator):
                raise
            return None, exc

    def _agreed_stop(self, rejected: SparkDLError | None) -> SparkDLError:
        error = (
            rejected
            if rejected is not None
            else PeerStopped(f"rank {self.ctx.rank} stopped because another worker rejected its input")
        )
        return agreed(error)

    def _before_step(self) -> None:
        if self.reseed is not None:
            # The random stream of a step depends only on (seed, rank, step): a resumed
            # run draws the same dropout masks as one that never failed.
            torch.manual_seed(self.reseed * 1_000_003 + self.ctx.rank * 7_919 + self.global_step)
        if self.drill is not None:
            self.drill.maybe_fire(self.ctx.rank, self.global_step, self.module)

    def _step(self, batch: TensorBatch, rows: int, plan: StepPlan, epoch: int) -> torch.Tensor:
        device = self.ctx.device
        x = batch[0].to(device, non_blocking=True)
        y = batch[1].to(device, non_blocking=True)
        output = self.module(x)
        if self.output_shape is None:
            self.output_shape = tuple(output.shape[1:])
            self.input_shape = tuple(x.shape[1:])
        loss = self.loss_fn(output, y)
        (loss * self.strategy.loss_scale(rows, plan.global_rows)).backward()
        self.strategy.after_backward(self.global_step)
        if self.guard is None or self.guard.allows_step(loss, self.module, epoch, self.global_step):
            if not self.strategy.applies_updates:
                self.optimizer.step()
            self.strategy.after_step(self.global_step, rows)
        else:  # skipped: nothing of this step reaches the weights
            if self.guard.failure is not None:
                self.strategy.stop(self.guard.failure)
            self.strategy.after_step(self.global_step, 0)
            loss = torch.zeros((), device=device)
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return loss

    def _check_labels(self, batch: TensorBatch) -> BadDataError | None:
        """Class labels the model has no output for, found before the step (so that the
        rejection reaches every rank through the step's control all-reduce)."""
        if self.label_kind is not LabelKind.CLASS_INDEX or not len(batch[1]):
            return None
        if self._classes is None:
            self._classes = self._probe_classes(batch[0][:1])
        labels = batch[1]
        bad = int((labels >= self._classes).sum())
        if not bad:
            return None
        return BadDataError(
            f"rank {self.ctx.rank}: {bad} labels are >= {self._classes}, the number of classes the "
            f"model outputs (largest label {int(labels.max())}); widen the model's last layer "
            "or re-index the labels",
            column="label",
            bad_rows=bad,
        )

    def _probe_classes(self, x: torch.Tensor) -> int:
        """The model's number of outputs, from one row through the bare module in eval mode
        (no collective, no batch-norm statistics touched, no random numbers drawn)."""
        bare = getattr(self.module, "module", self.module)  # DDP keeps the model in .module
        bare.eval()
        try:
            with torch.no_grad():
                output = bare(x.to(self.ctx.device))
        finally:
            bare.train()
        return int(output.shape[1]) if output.dim() > 1 else 1
