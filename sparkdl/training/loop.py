"""The per-worker training loop: torch and torch.distributed only, no Spark, no sockets.

The loop plans each step with every other worker (:mod:`sparkdl.training.planning`),
hands it to the sync strategy, which owns how it is taken, and runs the per-step hooks
(:mod:`sparkdl.training.hooks`). It never asks which strategy runs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from sparkdl.data.tensors import Batch, call_model
from sparkdl.errors import BadDataError, SparkDLError, agreed
from sparkdl.training.checkpointing import Position, Resume
from sparkdl.training.hooks import EpochTally, StepHook
from sparkdl.training.losses import LossFn
from sparkdl.training.planning import (
    Filler,
    StepCoordinator,
    StepPlan,
    Sum,
    coordinator_for,
    exchange_row_counts,
    next_batch,
    planned_steps,
)
from sparkdl.training.strategy import CollectiveForward, StepInput, SyncStats, SyncStrategy
from sparkdl.training.validation import EarlyStopping, Validator

log = logging.getLogger(__name__)


class LabelCheck(Protocol):
    """Finds labels the model cannot take in a batch, before its step (guards.LabelRangeCheck)."""

    def __call__(self, batch: Batch) -> BadDataError | None: ...

    def probe(self, batch: Batch) -> int:
        """Learn what the model takes from a batch now (a forward): where the forward is a
        collective, every rank runs it together before training."""
        ...


class EpochSource(Protocol):
    """Where a worker's batches come from, epoch after epoch (the partition feed)."""

    @property
    def cached_rows(self) -> int: ...

    def epoch(self, epoch: int) -> tuple[Iterable[Batch], str]: ...

    def fill_cache(self) -> None: ...


@dataclass(frozen=True)
class Schedule:
    """How long to train, and what the run resumes from.

    Attributes:
        epochs: epochs of the run.
        batch_size: rows of one feed batch on one worker.
        accumulate: feed batches per optimizer step (their gradients add up).
        start, resume: where the run starts, and the checkpoint it resumes from.
    """

    epochs: int
    batch_size: int
    start: Position = field(default_factory=Position)
    resume: Resume | None = None
    accumulate: int = 1

    @property
    def rows_per_step(self) -> int:
        return self.batch_size * self.accumulate


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
    peak_gpu_mb: float = 0.0  # the worker's peak CUDA memory so far (0 on CPU)
    peak_host_mb: float = 0.0  # the worker process's peak resident memory so far

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
        keyword: call the model as ``model(**inputs)`` (else ``model(x)``, one input).
        check_labels: finds labels the model cannot take, before the step (streaming only).
        filler: the zero-weight batch of a worker whose rows have run out.
        feed: the worker's batches.
        schedule: epochs, batch size and where to start.
        control_group: gloo group for the loop's small CPU messages.
        hooks: per-step extras (checkpoints, drill, progress), run in order.
        validator: measures the held-out rows after every epoch (None: no validation).
        early_stopping: stops on the validation loss and keeps the best weights.
    """

    def __init__(
        self,
        strategy: SyncStrategy,
        loss_fn: LossFn,
        keyword: bool,
        check_labels: LabelCheck,
        filler: Filler,
        feed: EpochSource,
        schedule: Schedule,
        control_group: dist.ProcessGroup | None,
        hooks: Sequence[StepHook] = (),
        validator: Validator | None = None,
        early_stopping: EarlyStopping | None = None,
    ) -> None:
        self.strategy = strategy
        self._ctx = strategy.ctx
        self._loss_fn = loss_fn
        self._keyword = keyword
        self._check_labels = check_labels
        self._filler = filler
        self._feed = feed
        self._schedule = schedule
        self._sum: Sum = self._ctx.exchange.sum_control_  # per step in epoch 1
        self._hooks = list(hooks)
        self._validator = validator
        self._early_stopping = early_stopping
        self.global_step = schedule.start.global_steps_done
        self.output_shape: tuple[int, ...] = ()
        self.input_shapes: dict[str, tuple[int, ...]] = {}
        self._shapes_seen = False
        self._precision = self._ctx.precision
        self._collective_forward = isinstance(strategy, CollectiveForward)

    def run(self) -> list[dict[str, Any]]:
        """Train from the schedule's start to its last epoch; return the history."""
        schedule, resume = self._schedule, self._schedule.resume
        history = list(resume.history) if resume else []
        start = schedule.start
        counts: list[int] | None = None
        if self._collective_forward and self._filler.available:
            # the label check's probe is a forward, a collective here: every rank runs it now, together
            self._check_labels.probe(self._filler.batch())
        if start.epoch > 1:  # the cache of this attempt is empty: refill it from Spark first
            self._feed.fill_cache()
            counts = self._exchange_row_counts()
        for epoch in range(start.epoch, schedule.epochs + 1):
            batches, source = self._feed.epoch(epoch)
            coordinator = coordinator_for(source == "spark", counts, schedule.rows_per_step, self._sum)
            skip = start.epoch_steps_done if epoch == start.epoch else 0
            result, tally = self.run_epoch(
                epoch, batches, coordinator, source, epoch == schedule.epochs, skip
            )
            if coordinator.streaming:
                counts = self._exchange_row_counts()
                if sum(counts) == 0:
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
            stop = self._validate(epoch, record)
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
            if stop:
                break
        if self._early_stopping is not None and self._early_stopping.restore(
            self.strategy.load_state_from_rank0
        ):
            history[-1]["restored_epoch"] = self._early_stopping.best_epoch
        return history

    def _validate(self, epoch: int, record: dict[str, Any]) -> bool:
        """Add the epoch's validation figures to ``record``; True when early stopping says stop."""
        if self._validator is None:
            return False
        self.strategy.finish()  # one model: every worker's weights made equal first
        lockstep = self._filler.batch if self._collective_forward else None
        figures = self._validator.evaluate(self._ctx.module, lockstep)
        record.update(figures)
        if self._early_stopping is None or "val_loss" not in figures:
            return False
        stop = self._early_stopping.update(epoch, figures["val_loss"], self.strategy.full_state_dict)
        if stop:
            log.info(
                "rank %d: early stop after epoch %d: val_loss has not improved on epoch %d's %.4f",
                self._ctx.rank,
                epoch,
                self._early_stopping.best_epoch,
                self._early_stopping.best_loss,
            )
        return stop

    def run_epoch(
        self,
        epoch: int,
        batches: Iterable[Batch],
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
        self.strategy.model.train()
        iterator = iter(batches)
        take = functools.partial(self._next_group, iterator, coordinator.streaming)
        for planned in planned_steps(take, coordinator, self._ctx.rank, skip_steps):
            if planned.plan is None:  # trained before the checkpoint: only consumed
                tally.steps += 1
                continue
            self._step(tally, planned.batches, planned.rows, planned.plan)
        if final:
            self.strategy.finish()
        if next(iterator, None) is not None:
            raise RuntimeError(
                f"rank {self._ctx.rank}: the step schedule ended before this worker's data did; "
                "this is a sparkdl bug, please report it"
            )
        totals = torch.tensor([tally.loss_value(), float(tally.samples)], dtype=torch.float64)
        self._sum(totals)
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
            nan_skips=tally.nan_skips,
            peak_gpu_mb=_peak_gpu_mb(self._ctx.device),
            peak_host_mb=peak_host_mb(),
        )
        return result, tally

    def _step(
        self,
        tally: EpochTally,
        group: tuple[Batch, ...],
        rows: int,
        plan: StepPlan,
    ) -> None:
        before = Position(tally.epoch, tally.steps, self.global_step)
        for hook in self._hooks:
            hook.before_step(before)
        step = StepInput(
            self.global_step,
            tally.epoch,
            group,
            rows,
            plan.global_rows,
            self._loss_of,
            self._filler.batch,
            self._loss_fn,
        )
        outcome = self.strategy.train_step(step)
        if outcome.trained:
            tally.loss_sum.add_(outcome.loss.detach(), alpha=rows)  # float64 sum, one kernel
            tally.samples += rows
        tally.nan_skips += outcome.nan_skipped
        tally.steps += 1
        self.global_step += 1
        after = Position(tally.epoch, tally.steps, self.global_step)
        for hook in self._hooks:
            hook.after_step(after, tally)

    def _loss_of(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The batch's mean loss (weighted by the weight column when there is one)."""
        device = self._ctx.device
        batch = batch.to(device)
        with self._precision.autocast():
            output = call_model(model, batch, self._keyword)
            if not self._shapes_seen:  # once: a model with scalar outputs has output_shape ()
                self.output_shape, self.input_shapes = tuple(output.shape[1:]), batch.shapes()
                self._shapes_seen = True
            return self._loss_fn(output, batch.label, batch.weight)

    def _exchange_row_counts(self) -> list[int]:
        ctx = self._ctx
        return exchange_row_counts(ctx.rank, ctx.world_size, self._feed.cached_rows, self._sum)

    def _next_group(
        self, iterator: Iterator[Batch], streaming: bool
    ) -> tuple[tuple[Batch, ...], SparkDLError | None]:
        """The next step's micro-batches (up to ``accumulate``; none once the rows have run
        out) and, while streaming, the error of an input this worker rejects."""
        group: list[Batch] = []
        for _ in range(self._schedule.accumulate):
            batch, rejected = next_batch(iterator, streaming)
            if rejected is None and batch is not None and streaming:
                rejected = self._check_labels(batch)
            if rejected is not None:
                return (), rejected
            if batch is None:
                break
            self._filler.remember(batch)
            group.append(batch)
        return tuple(group), None


def peak_host_mb() -> float:
    """This process's peak resident memory so far, in MB (``VmHWM``; 0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    return 0.0


def _peak_gpu_mb(device: torch.device) -> float:
    """The peak memory torch allocated on ``device`` so far, in MB (0 for a CPU)."""
    return torch.cuda.max_memory_allocated(device) / 1e6 if device.type == "cuda" else 0.0
