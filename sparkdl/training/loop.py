"""The per-worker training loop: torch and torch.distributed only, no Spark, no sockets.

The loop plans each step with every other worker (:mod:`sparkdl.training.planning`),
hands it to the sync strategy, which owns how it is taken, and runs the per-step hooks
(:mod:`sparkdl.training.hooks`). It never asks which strategy runs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from sparkdl.errors import BadDataError, PeerStopped, SchemaError, SparkDLError, agreed
from sparkdl.strategies.base import StepInput, SyncStats, SyncStrategy
from sparkdl.training.checkpointing import Position, Resume
from sparkdl.training.hooks import EpochTally, StepHook
from sparkdl.training.losses import LossFn
from sparkdl.training.planning import (
    BatchShape,
    Filler,
    InputRejected,
    PartitionInfo,
    StepCoordinator,
    StepPlan,
    TensorBatch,
    coordinator_for,
    exchange_partition_info,
)

log = logging.getLogger(__name__)

LabelCheck = Callable[[TensorBatch], BadDataError | None]


class EpochSource(Protocol):
    """Where a worker's batches come from, epoch after epoch (the partition feed)."""

    @property
    def cached_rows(self) -> int: ...

    def widths(self) -> tuple[int, int]: ...

    def epoch(self, epoch: int) -> tuple[Iterable[TensorBatch], str]: ...

    def fill_cache(self) -> None: ...


@dataclass(frozen=True)
class Schedule:
    """How long to train, and what the run resumes from."""

    epochs: int
    batch_size: int
    start: Position = field(default_factory=Position)
    resume: Resume | None = None


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

    def record(self) -> dict[str, Any]:
        """The epoch's entry of ``history``: its figures and the strategy's, flat."""
        record = asdict(self)
        record.update(record.pop("sync"))
        record["samples_per_s"] = self.samples / self.seconds if self.seconds > 0 else 0.0
        return record


class Trainer:
    """Runs every epoch on one worker.

    Args:
        strategy: the sync strategy, built complete.
        loss_fn: ``loss(output, target)`` returning the mean loss of the batch.
        check_labels: finds labels the model cannot take, before the step (streaming only).
        filler: the zero-weight batch of a worker whose rows have run out.
        feed: the worker's batches.
        schedule: epochs, batch size and where to start.
        control_group: gloo group for the loop's small CPU messages.
        hooks: per-step extras (checkpoints, drill, progress), run in order.
    """

    def __init__(
        self,
        strategy: SyncStrategy,
        loss_fn: LossFn,
        check_labels: LabelCheck,
        filler: Filler,
        feed: EpochSource,
        schedule: Schedule,
        control_group: dist.ProcessGroup | None,
        hooks: Sequence[StepHook] = (),
    ) -> None:
        self.strategy = strategy
        self._ctx = strategy.ctx
        self._loss_fn = loss_fn
        self._check_labels = check_labels
        self._filler = filler
        self._feed = feed
        self._schedule = schedule
        self._group = control_group
        self._hooks = list(hooks)
        self.global_step = schedule.start.global_steps_done
        self.output_shape: tuple[int, ...] = ()
        self.input_shape: tuple[int, ...] = ()
        self._shapes_seen = False

    def run(self) -> list[dict[str, Any]]:
        """Train from the schedule's start to its last epoch; return the history."""
        schedule, resume = self._schedule, self._schedule.resume
        history = list(resume.history) if resume else []
        start = schedule.start
        partitions: PartitionInfo | None = None
        if start.epoch > 1:  # the cache of this attempt is empty: refill it from Spark first
            self._feed.fill_cache()
            partitions = self._exchange_partition_info()
        for epoch in range(start.epoch, schedule.epochs + 1):
            batches, source = self._feed.epoch(epoch)
            coordinator = coordinator_for(source == "spark", partitions, schedule.batch_size, self._group)
            skip = start.epoch_steps_done if epoch == start.epoch else 0
            result, tally = self.run_epoch(
                epoch, batches, coordinator, source, epoch == schedule.epochs, skip
            )
            if coordinator.streaming:
                partitions = self._exchange_partition_info()
                if partitions.total_rows == 0:
                    raise agreed(
                        BadDataError(
                            "the DataFrame given to fit has no rows: every partition was empty. "
                            "Check the filters and joins upstream of fit",
                            bad_rows=0,
                        )
                    )
            record = result.record()
            if resume is not None and epoch == start.epoch:
                record.update(
                    resumed_from_step=start.global_steps_done,
                    steps_redone=resume.steps_redone,
                    recovery_s=resume.recovered_at - resume.recovery_started,
                )
            history.append(record)
            for hook in self._hooks:
                hook.after_epoch(Position(epoch + 1, 0, self.global_step), tally, history)
            log.info(
                "rank %d epoch %d loss %.4f (%d samples, %.2fs)",
                self._ctx.rank,
                epoch,
                result.loss,
                result.samples,
                result.seconds,
            )
        return history

    def run_epoch(
        self,
        epoch: int,
        batches: Iterable[TensorBatch],
        coordinator: StepCoordinator,
        source: str,
        final: bool = False,
        skip_steps: int = 0,
    ) -> tuple[EpochResult, EpochTally]:
        """Train one epoch; every worker must call this with matching arguments.

        ``final`` marks the last epoch: the strategy then makes every worker's weights
        equal (e.g. a last weight average) before the epoch's figures close.
        ``skip_steps`` steps (done before a failure, restored from a checkpoint) only
        consume their batches.
        """
        loss_sum = torch.zeros((), dtype=torch.float64, device=self._ctx.device)
        tally = EpochTally(epoch, coordinator.total_steps, time.perf_counter(), loss_sum=loss_sum)
        skips_before = self.strategy.guard.skipped
        self.strategy.model.train()
        iterator = iter(batches)
        while True:
            batch, rejected = self._next_batch(iterator, coordinator.streaming)
            if batch is not None:
                self._filler.remember(batch)
            if tally.steps < skip_steps:
                coordinator.skip()
                tally.steps += 1
                continue
            if coordinator.streaming and rejected is None and batch is not None:
                rejected = self._check_labels(batch)
            shape = BatchShape.of(batch)
            try:
                plan = coordinator.next_step(shape, rejected is not None)
            except InputRejected:
                raise self._agreed_stop(rejected) from rejected
            if plan is None:
                break
            self._step(tally, batch, shape, plan)
        if final:
            self.strategy.finish()
        if next(iterator, None) is not None:
            raise RuntimeError(
                f"rank {self._ctx.rank}: the step schedule ended before this worker's data did; "
                "this is a sparkdl bug, please report it"
            )
        totals = torch.tensor([tally.loss_value(), float(tally.samples)], dtype=torch.float64)
        dist.all_reduce(totals, group=self._group)
        global_loss, global_samples = totals.tolist()
        result = EpochResult(
            epoch=epoch,
            loss=global_loss / max(global_samples, 1.0),
            samples=int(global_samples),
            local_samples=tally.samples,
            steps=tally.steps,
            seconds=time.perf_counter() - tally.started,
            source=source,
            sync=self.strategy.end_epoch(),
            nan_skips=self.strategy.guard.skipped - skips_before,
        )
        return result, tally

    def _step(
        self,
        tally: EpochTally,
        batch: TensorBatch | None,
        shape: BatchShape,
        plan: StepPlan,
    ) -> None:
        before = Position(tally.epoch, tally.steps, self.global_step)
        for hook in self._hooks:
            hook.before_step(before)
        step = StepInput(
            self.global_step,
            tally.epoch,
            batch,
            shape.rows,
            plan.global_rows,
            self._loss_of,
            functools.partial(self._filler.batch, plan),
        )
        loss = self.strategy.train_step(step)
        tally.loss_sum += loss.detach().double() * shape.rows
        tally.samples += shape.rows
        tally.steps += 1
        self.global_step += 1
        after = Position(tally.epoch, tally.steps, self.global_step)
        for hook in self._hooks:
            hook.after_step(after, tally)

    def _loss_of(self, model: nn.Module, batch: TensorBatch) -> torch.Tensor:
        device = self._ctx.device
        x = batch[0].to(device, non_blocking=True)
        y = batch[1].to(device, non_blocking=True)
        output = model(x)
        if not self._shapes_seen:  # once: a model with scalar outputs has output_shape ()
            self.output_shape, self.input_shape = tuple(output.shape[1:]), tuple(x.shape[1:])
            self._shapes_seen = True
        return self._loss_fn(output, y)

    def _exchange_partition_info(self) -> PartitionInfo:
        ctx = self._ctx
        return exchange_partition_info(
            ctx.rank, ctx.world_size, self._feed.cached_rows, self._feed.widths(), self._group
        )

    @staticmethod
    def _next_batch(
        iterator: Iterator[TensorBatch], streaming: bool
    ) -> tuple[TensorBatch | None, SparkDLError | None]:
        """The next batch; while streaming, a rejected input is reported, not raised."""
        try:
            return next(iterator, None), None
        except (BadDataError, SchemaError) as exc:
            if not streaming:
                raise
            return None, exc

    def _agreed_stop(self, rejected: SparkDLError | None) -> SparkDLError:
        error = rejected or PeerStopped(
            f"rank {self._ctx.rank} stopped because another worker rejected its input"
        )
        return agreed(error)
