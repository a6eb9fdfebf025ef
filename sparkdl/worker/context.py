"""``ctx``: what ``sparkdl.run`` hands a user's own training function on every worker.

The abilities of the Estimator's loop, opened up: this worker's partition as batches of
tensors (the same typed inputs, decoders, bad-row checks, epoch cache and prefetch, every
rank taking the same number of steps per epoch), :meth:`TrainContext.prepare` for any
models and optimizers under the run's strategy, :meth:`TrainContext.report` for live
progress and the history, checkpoints a re-run stage resumes from, and the rank, world,
device and process group for anything else.

Collectives are matched: every rank must call :meth:`~TrainContext.batches` for the same
epochs and take every batch it yields (under all-reduce a worker whose rows ran out gets
filler batches, with :attr:`~TrainContext.step_rows` 0, whose gradients count zero; under
weight averaging and the parameter server it sits the rest of the epoch out, still
joining the averages and the pushes), and call
:meth:`~TrainContext.save_checkpoint` and :meth:`~TrainContext.load_checkpoint` at the
same points. A rank that does not join waits at most ``collective_timeout_s``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sparkdl.config import SparkDLConfig
from sparkdl.data.feed import PartitionFeed
from sparkdl.data.tensors import Batch
from sparkdl.errors import ConfigError, SparkDLError, agreed
from sparkdl.services.progress.board import Report
from sparkdl.services.progress.channel import ProgressReporter
from sparkdl.storage.checkpoint_store import CheckpointStore
from sparkdl.training.factory import cpu_state_dict
from sparkdl.training.own_loop import RunningStep
from sparkdl.training.planning import Filler, coordinator_for, exchange_row_counts, next_batch, planned_steps
from sparkdl.training.precision import Precision
from sparkdl.worker.assembly import chosen_checkpoint
from sparkdl.worker.prepare import Preparer

#: What a checkpoint file of a user's loop holds besides the user's state.
_FORMAT = 1


class TrainContext:
    """One worker's view of a ``sparkdl.run`` (see the module docstring).

    Attributes:
        rank, world_size: this worker and the number of workers.
        device: the worker's device (the GPU Spark gave its task, else the CPU).
        config: the run's settings.
        history: what :meth:`report` recorded on this worker.
    """

    def __init__(
        self,
        config: SparkDLConfig,
        rank: int,
        world_size: int,
        device: torch.device,
        preparer: Preparer,
        step: RunningStep,
        control: dist.ProcessGroup | None,
        feed: PartitionFeed | None = None,
        filler: Filler | None = None,
        reporter: ProgressReporter | None = None,
        checkpoints: CheckpointStore | None = None,
    ) -> None:
        self.config = config
        self.rank, self.world_size, self.device = rank, world_size, device
        self.history: list[dict[str, Any]] = []
        self._preparer, self._step, self._control = preparer, step, control
        self._feed, self._filler = feed, filler or Filler(None)
        self._reporter, self._checkpoints = reporter, checkpoints
        self._counts: list[int] | None = None
        self._epoch, self._epoch_steps, self._total_steps = 1, 0, -1
        self._loss_sum, self._loss_rows, self._samples = 0.0, 0, 0
        self._started = time.perf_counter()
        self.global_step = 0  # steps of batches(), over every epoch: the same count on every rank
        self._open_epoch = 0  # the epoch whose batches() has not reached its end
        self._epoch_done = False  # batches() reached the end of self._epoch
        self.resumed_from = 0  # the step of the checkpoint load_checkpoint returned

    # -- who and where ---------------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        """Rank 0: the one whose return value and history come back."""
        return self.rank == 0

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The run's default process group (gloo, or NCCL on GPUs), for your own collectives."""
        return dist.group.WORLD  # type: ignore[return-value]

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Run your forward and loss under this: ``training.precision`` as a setting (``bf16``:
        autocast to bfloat16 on the worker's device, weights and optimizer staying float32;
        ``fp32``: nothing changes). ``fp16`` is refused for your own loop: its gradient scaler
        belongs in your step (``torch.amp.GradScaler``)."""
        return Precision(self.config.training.precision, self.device).autocast()

    @property
    def epochs(self) -> range:
        """``range(1, training.epochs + 1)``: the epochs the run was configured with."""
        return range(1, self.config.training.epochs + 1)

    # -- data --------------------------------------------------------------------------------

    @property
    def step_rows(self) -> int:
        """This worker's rows in the batch :meth:`batches` yielded last (0: a filler, which
        only all-reduce yields: elsewhere a worker whose rows ran out sits the rest of the
        epoch out)."""
        return self._step.rows

    def batches(self, epoch: int | None = None) -> Iterator[Batch]:
        """This worker's batches of one epoch (1-based; default: the one after the last), on
        its device, ``training.batch_size`` rows each: ``batch.inputs`` (by name; one feature
        matrix under its input name), ``batch.label``, ``batch.weight``.

        Epoch 1 streams from Spark while it caches; later epochs replay the cache, shuffled
        per epoch with ``training.seed``. Every rank yields as many batches.

        Raises:
            ConfigError: the run was given no DataFrame.
            BadDataError, SchemaError: a bad row on any rank (every rank raises it together).
        """
        if self._feed is None:
            raise ConfigError("ctx.batches: sparkdl.run was given no DataFrame (df=None); pass df=...")
        if self._open_epoch:
            raise agreed(
                ConfigError(
                    f"rank {self.rank}: ctx.batches({self._open_epoch}) was left before its last batch; "
                    "every rank must take every batch of an epoch (the workers step together): do not "
                    "break out of it, skip the rest of the loop body instead"
                )
            )
        epoch = self._epoch + (1 if self._epoch_done else 0) if epoch is None else epoch
        self._start_epoch(epoch)
        self._preparer.epoch_begins()
        self._open_epoch = epoch
        batches, source = self._feed.epoch(epoch)
        sum_ = self._sum
        coordinator = coordinator_for(source == "spark", self._counts, self.config.training.batch_size, sum_)
        self._total_steps = coordinator.total_steps
        iterator = iter(batches)

        def take() -> tuple[tuple[Batch, ...], SparkDLError | None]:
            batch, rejected = next_batch(iterator, coordinator.streaming)
            return ((batch,) if batch is not None else ()), rejected

        try:
            for planned in planned_steps(take, coordinator, self.rank):
                assert planned.plan is not None  # nothing skipped: a loaded checkpoint's steps are trained
                self.global_step += 1
                self._epoch_steps += 1  # every rank counts every step, sat out or not
                batch = planned.batches[0] if planned.batches else None
                if batch is not None:
                    self._filler.remember(batch)
                elif not self._preparer.needs_fillers:  # its strategy's steps are local: sit it out
                    self._preparer.step_done(self.global_step - 1, 0)
                    continue
                rows = planned.rows
                self._step.rows, self._step.inside = rows, True
                self._step.scale = self.world_size * rows / planned.plan.global_rows
                self._samples += rows
                yield (batch if batch is not None else self._filler.batch()).to(self.device)
                # the steps up to a loaded checkpoint's were trained before it: none of their rows count
                self._preparer.step_done(
                    self.global_step - 1, rows if self.global_step > self.resumed_from else 0
                )
        finally:  # a backward outside the feed (an evaluation) is not scaled
            self._step.rows, self._step.scale, self._step.inside = 1, 1.0, False
        if coordinator.streaming:
            self._counts = exchange_row_counts(self.rank, self.world_size, self._feed.cached_rows, sum_)
        self._open_epoch, self._epoch_done = 0, True
        self._total_steps = self._epoch_steps  # the epoch's last report: its length is known
        self._send_report()
        if epoch == self.config.training.epochs:  # the code after the loop sees the final weights
            self._preparer.finish(self.global_step)

    def finish(self) -> None:
        """The function returned: the strategies' last sync (every rank together), as at the
        end of the configured last epoch (again: steps since then, e.g. more epochs, count).

        Raises:
            ConfigError: the function left ``ctx.batches`` before the end of an epoch.
        """
        if self._open_epoch:
            raise agreed(
                ConfigError(
                    f"rank {self.rank}: the function returned inside ctx.batches({self._open_epoch}); every "
                    "rank must take every batch of an epoch (the workers step together): do not break "
                    "out of it"
                )
            )
        self._preparer.finish(self.global_step)

    def _sum(self, tensor: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self._control)

    # -- the models ------------------------------------------------------------------------------

    def prepare(self, *objects: Any) -> Any:
        """Make models and optimizers ready for the run's strategy (see
        :mod:`sparkdl.worker.prepare`); returns them in the order given (one object alone
        when one is given). Call it once per model, on every rank."""
        prepared = self._preparer.prepare(*objects)
        return prepared[0] if len(prepared) == 1 else prepared

    def state_dict(self, thing: Any) -> dict[str, Any]:
        """The whole state of a prepared model or optimizer, as the plain one would give it
        (no DDP prefix; an optimizer's numbered as ``optimizer.state_dict()`` numbers it), as
        CPU tensors on rank 0 and ``{}`` on the other ranks. Every rank calls it at the same
        point: under fsdp it gathers the shards (a collective). Save it with
        :meth:`save_checkpoint`, return it from ``train_fn``: it loads into a plain model, and
        with :meth:`load_state_dict` under any strategy and number of workers.

        Raises:
            ConfigError: ``thing`` was never prepared.
        """
        face = self._preparer.face_of(thing)
        if face is None:  # a model prepared without an optimizer: the same on every rank
            return cpu_state_dict(thing) if self.rank == 0 else {}
        if isinstance(thing, nn.Module):
            return face.model_state()
        return face.optimizer_state(thing)

    def load_state_dict(self, thing: Any, state: Mapping[str, Any]) -> None:
        """Load ``state``, a whole state as :meth:`state_dict` (or a plain model or optimizer)
        gives it, into a prepared model or optimizer; every rank calls it with the same state
        (what :meth:`load_checkpoint` returns): under fsdp each rank keeps its shards.

        Raises:
            ConfigError: ``thing`` was never prepared; the parameter server's model (the
                server holds its weights).
        """
        face = self._preparer.face_of(thing)
        if face is None:
            thing.load_state_dict(state)
        elif isinstance(thing, nn.Module):
            face.load_model_state(dict(state))
            self._preparer.weights_loaded()
        else:
            face.load_optimizer_state(thing, dict(state))

    # -- progress ---------------------------------------------------------------------------------

    def report(self, **metrics: float) -> None:
        """Record figures of the running step or epoch (``loss=...`` drives the progress
        bar): kept in the history (rank 0's comes back from the run), and sent to the
        driver's progress channel at most every ``progress_interval_s``."""
        record: dict[str, Any] = {"epoch": self._epoch, "step": self.global_step}
        record.update({k: float(v) for k, v in metrics.items()})
        self.history.append(record)
        if "loss" in metrics:  # the bar's loss: the mean of the reported losses, by their rows
            rows = max(self._step.rows, 1)
            self._loss_sum += float(metrics["loss"]) * rows
            self._loss_rows += rows
        reporter = self._reporter
        # after the epoch's batches (its last report just went out), a figure reported then
        # (an epoch's mean loss, a validation) goes out at once, not at the next interval
        if reporter is not None and (reporter.due() or self._epoch_done):
            self._send_report()

    def _send_report(self) -> None:
        """The running epoch's figures to the driver's progress channel (an epoch past the
        configured ones, e.g. a loop that trains longer, has no bar there)."""
        reporter = self._reporter
        if reporter is None or not 1 <= self._epoch <= self.config.training.epochs:
            return
        # the mean of the reported losses, by their rows, over the epoch's rows; NaN: none reported
        loss = self._loss_sum / self._loss_rows if self._loss_rows else math.nan
        reporter.send(
            Report(
                rank=self.rank,
                epoch=self._epoch,
                attempt=reporter.attempt,
                steps=self._epoch_steps,
                total_steps=self._total_steps,
                samples=self._samples,
                loss_sum=loss * self._samples,
                seconds=time.perf_counter() - self._started,
            )
        )

    def _start_epoch(self, epoch: int) -> None:
        self._epoch, self._epoch_steps, self._total_steps = epoch, 0, -1
        self._loss_sum, self._loss_rows, self._samples = 0.0, 0, 0
        self._started = time.perf_counter()
        self._epoch_done = False

    # -- checkpoints --------------------------------------------------------------------------------

    def save_checkpoint(self, state: Mapping[str, Any], step: int | None = None) -> None:
        """Save ``state`` (tensors, numbers, strings, lists and dicts of them: what loads with
        ``weights_only``) as the checkpoint of ``step`` (default: the global step); rank 0
        writes, every rank calls it. A re-run of the stage resumes from the newest.

        Raises:
            ConfigError: no ``checkpoint_dir`` was set.
        """
        store = self._store()
        if self.rank == 0:
            at = self.global_step if step is None else step
            entries = self._preparer.checkpoint_entries(at)
            store.save(at, {"format": _FORMAT, "state": dict(state), "strategies": entries})
        if self.world_size > 1:
            dist.barrier(group=self._control)

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The newest checkpoint's state (the same one on every rank), or None on a fresh
        start; every rank calls it. Sets :attr:`resumed_from` to the checkpoint's step: the
        loop then consumes the batches of the steps before it without training on them
        (:attr:`global_step` counts the steps of :meth:`batches`, skipped ones too: compare
        it with :attr:`resumed_from` after each batch).

        Raises:
            ConfigError: no ``checkpoint_dir`` was set.
            CheckpointError: the file is not one sparkdl wrote.
        """
        store = self._store()
        step = chosen_checkpoint(store, self.rank, self._control)
        if step is None:
            return None
        self.resumed_from = step
        saved = store.load(step)
        self._preparer.resume(saved.get("strategies", []))
        return dict(saved["state"])

    def _store(self) -> CheckpointStore:
        if self._checkpoints is None:
            raise ConfigError(
                "ctx.save_checkpoint / ctx.load_checkpoint need a directory every worker reaches: "
                "pass checkpoint_dir=... to sparkdl.run"
            )
        return self._checkpoints
