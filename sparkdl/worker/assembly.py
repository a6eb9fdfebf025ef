"""One place assembles a worker: device, process groups, model, optimizer, checkpoint
restore, strategy, feed, hooks, trainer, progress; one exit stack tears it down.

No Spark here: :func:`run_worker` takes plain arguments (the barrier's allGather among
them), so tests drive it in-process or in spawned processes.

Teardown order (the exit stack runs it in reverse of assembly, on success and on
error alike): the teardown watchdog is armed; the feed's prefetch thread stops; the
strategy lets go of DDP's reducer and its sockets; the checkpoint store closes; gloo's
threads are given the GIL to drop their last works, then the process groups are
destroyed; the progress reporter closes last, so a teardown error still reaches the
driver. Destroying a gloo group joins its threads while holding the GIL; a thread
still freeing a work needs the GIL too, and the worker would hang forever (seen once
in 150 fits). Releasing the GIL before the destroy removes that race; the watchdog
bounds whatever else might block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import torch
import torch.distributed as dist

from sparkdl.comm.ps_endpoint import PsEndpoint
from sparkdl.comm.rendezvous import AllGather
from sparkdl.config import OnError, OptimizerName, SparkDLConfig
from sparkdl.data.columns import LabelKind
from sparkdl.data.feed import FeedOptions, PartitionFeed
from sparkdl.data.inputs import DataPlan
from sparkdl.data.tensors import Batch
from sparkdl.services.meeting.endpoint import MeetingPoint
from sparkdl.services.progress.board import Report
from sparkdl.services.progress.channel import (
    ProgressEndpoint,
    ProgressReporter,
)
from sparkdl.services.ps.client import PsClient
from sparkdl.services.weights.client import upload
from sparkdl.services.weights.endpoint import WeightsEndpoint
from sparkdl.storage.checkpoint_store import CheckpointStore
from sparkdl.strategies import StrategyContext, SyncStrategy
from sparkdl.training.checkpointing import Checkpointer, Position, Resume, restore
from sparkdl.training.factory import ModelFn, OptimizerFn, ParallelizeFn, build_optimizer, cpu_state_dict
from sparkdl.training.full_batch import FullBatchTrainer
from sparkdl.training.guards import LabelRangeCheck, no_label_check
from sparkdl.training.hooks import (
    CheckpointHook,
    DrillHook,
    FirstStepHook,
    ProgressHook,
    ProgressUpdate,
    ReseedHook,
    StepHook,
)
from sparkdl.training.loop import Schedule, Trainer
from sparkdl.training.losses import LossFn, resolve_loss
from sparkdl.training.planning import Filler
from sparkdl.training.schedules import CONSTANT_LR, LrPlan
from sparkdl.training.strategy import SchedulerFn
from sparkdl.training.validation import EarlyStopping, Validator
from sparkdl.worker.builder import Builder, Placement, start_worker
from sparkdl.worker.full_batch import ServedPasses, full_batch_trainer

__all__ = ["Placement", "TrainSpec", "WorkerResult", "build_trainer", "feed_options", "run_worker"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSpec:
    """Everything a worker needs, shipped to executors with the task (cloudpickled)."""

    config: SparkDLConfig
    model_fn: ModelFn
    optimizer_fn: OptimizerFn | None
    loss: str | LossFn
    plan: DataPlan
    template: Batch | None = None  # two decoded rows: what a worker without rows steps on
    lr: LrPlan = CONSTANT_LR  # the learning-rate schedule (a factor of lr per global step)
    scheduler_fn: SchedulerFn | None = None  # the user's LR scheduler, stepped every step
    parallelize_fn: ParallelizeFn | None = None  # strategy "tensor": the user's own split
    ps: PsEndpoint | None = None  # set by fit for strategy = "parameter_server"
    progress: ProgressEndpoint | None = None  # the driver's progress channel, when it listens
    weights: WeightsEndpoint | None = None  # where rank 0 sends the trained weights (else: the result row)
    meeting: MeetingPoint | None = None  # the driver's store the ranks gather at (else: Spark's allGather)


@dataclass
class WorkerResult:
    """What one worker sends back: its figures, and the weights on rank 0."""

    rank: int
    rows: int
    bad_rows: int
    history: list[dict[str, Any]]
    state: bytes
    output_shape: tuple[int, ...]
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # one row of each input
    # {"device": "cuda:0", "gpus": ["0"], "exchange": "nccl", "host": "10.0.0.5"}: exchange is the
    # process group's backend, or "shared_memory" where the workers of one host exchange through it
    # (see _exchange); host is the executor's address, the one the process group binds
    device: dict[str, Any] = field(default_factory=dict)


def run_worker(
    spec: TrainSpec, batches: Iterator[pa.RecordBatch], placement: Placement, all_gather: AllGather
) -> WorkerResult:
    """Train on this worker's partition; return its history (and the weights on rank 0)."""
    config, rank = spec.config, placement.rank
    with contextlib.ExitStack() as stack:
        started = start_worker(config, placement, all_gather, spec.progress, stack)
        device, groups, reporter = started.device, started.groups, started.reporter
        attempt = groups.attempt  # known once the ranks have met
        build = Builder(config, started.where, groups, started.hierarchy, stack)
        # before the optimizer: a sharding strategy shards here, the optimizer holds the shards
        module = build.module(spec.model_fn, spec.parallelize_fn)
        exchange = build.exchange(module)
        store = checkpoint_store(config, stack)
        trainer: Trainer | FullBatchTrainer | ServedPasses
        if config.optimizer.optimizer is OptimizerName.LBFGS:  # full batch: no steps, no strategy
            feed = PartitionFeed(batches, spec.plan, feed_options(config, rank, device))
            stack.callback(feed.close)
            send = _sender(reporter) if reporter is not None else None
            served = PsClient(spec.ps, rank, attempt) if spec.ps is not None else None
            if served is not None:
                stack.callback(served.close)
            trainer = full_batch_trainer(
                config, spec.loss, spec.plan.keyword, _label_name(spec), rank, module, exchange, feed,
                bool(spec.plan.validation_col), store, send, served,
            )  # fmt: skip
            stack.callback(started.watchdog.arm)  # runs first on the way out: it bounds everything after it
            history = trainer.run()
            state = cpu_state_dict(module)
        else:
            optimizer = build_optimizer(module.parameters(), spec.optimizer_fn, config.optimizer)
            resume = _resume(store, rank, module, optimizer, groups.control, build.kind)
            start = resume.position if resume else Position()
            strategy = build.strategy(
                module,
                optimizer,
                exchange,
                ps=spec.ps,
                start_step=start.global_steps_done,
                lr=spec.lr,
                scheduler_fn=spec.scheduler_fn,
                resumed_state=resume.strategy_state if resume else None,
            )
            feed = PartitionFeed(batches, spec.plan, feed_options(config, rank, device))
            stack.callback(feed.close)
            hooks = _hooks(spec, rank, module, optimizer, strategy, store, reporter)
            schedule = _schedule(config, start, resume)
            trainer = build_trainer(spec, strategy.ctx, strategy, feed, schedule, hooks)
            stack.callback(started.watchdog.arm)  # runs first on the way out: it bounds everything after it
            history = trainer.run()
            if store is not None:  # the last checkpoint's write, bounded by its own timeout, not teardown's
                store.flush()
            state = strategy.full_state_dict()  # on every rank: a gather where the model is sharded
        return WorkerResult(
            rank,
            feed.cached_rows,
            feed.bad_rows_dropped,
            history,
            _deliver_weights(spec, state) if rank == 0 else b"",
            trainer.output_shape,
            trainer.input_shapes,
            {
                "device": str(device),
                "gpus": list(placement.gpu_addresses),
                "exchange": exchange.name,
                "host": placement.host,
            },
        )
    raise AssertionError("unreachable")  # pragma: no cover - the stack re-raises or returns


def _schedule(config: SparkDLConfig, start: Position, resume: Resume | None) -> Schedule:
    training = config.training
    return Schedule(training.epochs, training.batch_size, start, resume, training.accumulate_steps)


def _deliver_weights(spec: TrainSpec, state: dict[str, torch.Tensor]) -> bytes:
    """Rank 0's trained weights for the driver: streamed to its weights server, so they never
    cross the JVM (the result row then carries none); in the result row where the driver
    cannot be reached (a Spark Connect client)."""
    if spec.weights is None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()
    sent = upload(spec.weights, state)
    log.info("rank 0 sent %.1f MB of trained weights to the driver", sent / 1e6)
    return b""


def build_trainer(
    spec: TrainSpec,
    context: StrategyContext,
    strategy: SyncStrategy,
    feed: PartitionFeed,
    schedule: Schedule,
    hooks: list[StepHook],
) -> Trainer:
    loss_fn, label_kind = resolve_loss(spec.loss)
    keyword = spec.plan.keyword
    check_labels = (
        LabelRangeCheck(context.module, context.device, context.rank, _label_name(spec), keyword)
        if label_kind is LabelKind.CLASS_INDEX
        else no_label_check
    )
    validator = early_stopping = None
    if spec.plan.validation_col:
        batch_size = spec.config.data.inference_batch_size
        validator = Validator(
            lambda: feed.validation_batches(batch_size),
            loss_fn,
            label_kind,
            keyword,
            context.device,
            context.control_group,
        )
        patience = spec.config.training.early_stopping_patience
        early_stopping = EarlyStopping(patience, keep_weights=context.rank == 0) if patience else None
    return Trainer(
        strategy,
        loss_fn,
        keyword,
        check_labels,
        Filler(spec.template),
        feed,
        schedule,
        context.control_group,
        hooks,
        validator,
        early_stopping,
    )


def _label_name(spec: TrainSpec) -> str:
    return spec.plan.label.name if spec.plan.label else "label"


def _hooks(
    spec: TrainSpec,
    rank: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    strategy: SyncStrategy,
    store: CheckpointStore | None,
    reporter: ProgressReporter | None,
) -> list[StepHook]:
    """The per-step extras this worker runs, in order."""
    config = spec.config
    hooks: list[StepHook] = []
    if store is not None:
        hooks.append(ReseedHook(config.training.seed, strategy.random_stream))
    drill = config.reliability.drill
    if drill is not None:
        hooks.append(DrillHook(drill, rank, module))
    if store is not None:
        checkpointer = Checkpointer(
            store, config.reliability.checkpoint_every, rank, module, optimizer, strategy
        )
        hooks.append(CheckpointHook(checkpointer))
    if reporter is not None:
        hooks.append(ProgressHook(_sender(reporter), reporter.due))
    if config.training.compile:
        hooks.append(FirstStepHook())
    return hooks


def _sender(reporter: ProgressReporter) -> Callable[[ProgressUpdate], None]:
    """The loop's progress callable: its update, stamped with this worker's rank and attempt."""

    def send(update: ProgressUpdate) -> None:
        reporter.send(Report(rank=reporter.rank, attempt=reporter.attempt, **dataclasses.asdict(update)))

    return send


def checkpoint_store(config: SparkDLConfig, stack: contextlib.ExitStack) -> CheckpointStore | None:
    if not config.reliability.checkpoint_dir:
        return None
    reliability = config.reliability
    store = CheckpointStore(
        reliability.checkpoint_dir,
        options=reliability.storage_options,
        background=True,  # on an object store: the step waits for torch.save to memory, not the upload
        upload_timeout_s=reliability.checkpoint_upload_timeout_s,
    )
    # on an error: the upload in flight is given a little time, and the error stays the one reported
    stack.push(lambda kind, error, trace: store.close(failing=error is not None))
    return store


def _resume(
    store: CheckpointStore | None,
    rank: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    control: dist.ProcessGroup | None,
    kind: type[SyncStrategy],
) -> Resume | None:
    """Rank 0 picks the checkpoint and tells the others (over the control group), so that
    every rank loads the same one; the strategy ``kind`` loads it (into shards, for fsdp)."""
    if store is None:
        return None
    step = chosen_checkpoint(store, rank, control)
    if step is None:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    shards = kind.load_shards if kind.writes_shards else None
    return restore(store, step, rank, module, optimizer, kind.load_full_state, world, shards)


def chosen_checkpoint(store: CheckpointStore, rank: int, control: dist.ProcessGroup | None) -> int | None:
    """The step of the checkpoint every rank resumes from (None: a fresh start): rank 0
    picks the newest and tells the others (over the control group), so that every rank
    loads the same one even while a newer one is being written."""
    latest = store.latest() if rank == 0 else None
    chosen = torch.tensor([-1 if latest is None else latest], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(chosen, src=0, group=control)
    step = int(chosen.item())
    return step if step >= 0 else None


def feed_options(config: SparkDLConfig, rank: int, device: torch.device) -> FeedOptions:
    return FeedOptions(
        batch_size=config.training.batch_size,
        shuffle=config.training.shuffle and config.optimizer.optimizer is not OptimizerName.LBFGS,
        seed=config.training.seed,
        rank=rank,
        prefetch_batches=config.data.prefetch_batches,
        cache_dir=config.data.cache_dir or os.environ.get("SPARK_LOCAL_DIRS", "").split(",")[0],
        cache_memory_bytes=config.data.cache_memory_mb << 20,
        cache_memory_keep_s=config.data.cache_memory_keep_s,
        pin_memory=device.type == "cuda",
        skip_bad_rows=config.reliability.on_bad_rows is OnError.SKIP,
    )
