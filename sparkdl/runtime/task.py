"""What runs inside each barrier task on an executor: one worker of the training job.

``train_partition`` is the module-level function handed to ``mapInArrow``; it reads
the barrier context and calls :func:`run_worker`, which takes plain arguments so
that tests can drive it in-process without Spark.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import torch

from sparkdl.checkpoint import CheckpointStore
from sparkdl.config import OnError, SparkDLConfig, Strategy
from sparkdl.data.columns import ColumnPlan
from sparkdl.data.feed import FeedOptions, PartitionFeed
from sparkdl.errors import BadDataError, SparkDLError, TrainingFailedError, agreed
from sparkdl.progress.channel import ProgressEndpoint, reporting_to_driver
from sparkdl.ps.server import PsEndpoint
from sparkdl.runtime.device import choose_backend, choose_device
from sparkdl.runtime.rendezvous import AllGather, form_process_group
from sparkdl.strategies import WorkerContext, create_strategy
from sparkdl.training.checkpointing import Checkpointer, Position, Resume
from sparkdl.training.factory import ModelFn, OptimizerFn, build_model, build_optimizer, state_to_bytes
from sparkdl.training.guards import FaultDrill, NanGuard
from sparkdl.training.loop import (
    EpochResult,
    PartitionInfo,
    ScheduledCoordinator,
    StepCoordinator,
    StreamingCoordinator,
    Trainer,
    exchange_partition_info,
)
from sparkdl.training.losses import LossFn, resolve_loss

log = logging.getLogger(__name__)

RESULT_SCHEMA = (
    "rank int, rows long, bad_rows long, history string, state binary, input_shape string, "
    "output_shape string, device string, error string"
)
RESULT_ARROW_SCHEMA = pa.schema(
    [
        ("rank", pa.int32()),
        ("rows", pa.int64()),
        ("bad_rows", pa.int64()),
        ("history", pa.string()),
        ("state", pa.binary()),
        ("input_shape", pa.string()),
        ("output_shape", pa.string()),
        ("device", pa.string()),
        ("error", pa.string()),
    ]
)


@dataclass(frozen=True)
class TrainSpec:
    """Everything a worker needs, shipped to executors with the task (cloudpickled)."""

    config: SparkDLConfig
    model_fn: ModelFn
    optimizer_fn: OptimizerFn | None
    loss: str | LossFn
    plan: ColumnPlan
    ps: PsEndpoint | None = None  # set by fit for strategy = "parameter_server"
    progress: ProgressEndpoint | None = None  # the driver's progress channel, when it listens


@dataclass
class WorkerResult:
    rank: int
    rows: int
    bad_rows: int
    history: list[dict[str, Any]]
    state: bytes
    output_shape: tuple[int, ...]
    error: str = ""  # "ErrorClass: message" when every rank stopped together on bad input
    input_shape: tuple[int, ...] = ()  # one row of features, as the model saw it
    device: dict[str, Any] = field(default_factory=dict)  # {"device": "cuda:0", "gpus": ["0"]}

    def to_record_batch(self) -> pa.RecordBatch:
        return pa.RecordBatch.from_pydict(
            {
                "rank": [self.rank],
                "rows": [self.rows],
                "bad_rows": [self.bad_rows],
                "history": [json.dumps(self.history)],
                "state": [self.state],
                "input_shape": [json.dumps(list(self.input_shape))],
                "output_shape": [json.dumps(list(self.output_shape))],
                "device": [json.dumps(self.device)],
                "error": [self.error],
            },
            schema=RESULT_ARROW_SCHEMA,
        )


def train_partition(spec: TrainSpec, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function of the barrier training stage."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    rank = ctx.partitionId()
    infos = ctx.getTaskInfos()
    host = infos[rank].address.rsplit(":", 1)[0]
    resources = ctx.resources()
    gpus = list(resources["gpu"].addresses) if "gpu" in resources else []
    threads = spec.config.runtime.torch_threads or int(ctx.cpus() or 1)
    # One number per stage attempt, the same on every rank: a re-run stage gets a new one.
    attempt = min(int(m) for m in ctx.allGather(str(ctx.taskAttemptId()))) if spec.ps or spec.progress else 0
    try:
        result = run_worker(spec, batches, rank, len(infos), host, gpus, ctx.allGather, threads, attempt)
    except SparkDLError as exc:
        if getattr(exc, "agreed_by_all_ranks", False):
            # Every rank stopped together: end the task normally and let the driver raise,
            # rather than fail it and have Spark re-run a stage that would fail alike.
            failed = _with_rank(exc, rank)
            yield WorkerResult(
                rank, 0, 0, [], b"", (), f"{type(failed).__name__}: {failed}"
            ).to_record_batch()
            return
        raise _with_rank(exc, rank) from exc
    except Exception as exc:
        raise TrainingFailedError(
            f"rank {rank} (task attempt {ctx.attemptNumber()}) failed: {type(exc).__name__}: {exc}",
            {rank: f"{type(exc).__name__}: {exc}"},
        ) from exc
    yield result.to_record_batch()


def _with_rank(exc: SparkDLError, rank: int) -> SparkDLError:
    """The same error, its message prefixed with the rank (built as when unpickled)."""
    if exc.message.startswith(f"rank {rank}"):
        return exc
    cls, args = exc.__reduce__()[:2]
    return cls(f"rank {rank}: {args[0]}", *args[1:])


def run_worker(
    spec: TrainSpec,
    batches: Iterator[pa.RecordBatch],
    rank: int,
    world_size: int,
    host: str,
    gpu_addresses: list[str],
    all_gather: AllGather,
    torch_threads: int = 1,
    attempt: int = 0,
) -> WorkerResult:
    """Train on this worker's partition and return its history (and weights on rank 0)."""
    with reporting_to_driver(spec.progress, rank, attempt) as reporter:
        config = spec.config
        runtime = config.runtime
        torch.set_num_threads(torch_threads)
        if runtime.network_interface:
            os.environ["GLOO_SOCKET_IFNAME"] = runtime.network_interface
            os.environ["NCCL_SOCKET_IFNAME"] = runtime.network_interface
        device = choose_device(runtime.use_gpu, gpu_addresses, torch.cuda.device_count(), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = choose_backend(runtime.backend, device)
        groups = form_process_group(rank, world_size, host, backend, all_gather, runtime.collective_timeout_s)
        feed: PartitionFeed | None = None
        store: CheckpointStore | None = None
        strategy = None
        reliability = config.reliability
        try:
            torch.manual_seed(config.training.seed)
            module = build_model(spec.model_fn).to(device)
            optimizer = build_optimizer(module.parameters(), spec.optimizer_fn, config.optimizer)
            checkpointer = resume = None
            if reliability.checkpoint_dir:
                store = CheckpointStore(reliability.checkpoint_dir)
                align = (
                    config.training.sync_every if config.training.strategy is Strategy.WEIGHT_AVERAGING else 1
                )
                checkpointer = Checkpointer(
                    store, reliability.checkpoint_every, rank, module, optimizer, align
                )
                # rank 0 picks the checkpoint, so that every rank loads the same one
                latest = store.latest() if rank == 0 else None
                chosen = int(all_gather(str(-1 if latest is None else latest))[0])
                if chosen >= 0:
                    resume = checkpointer.restore(chosen)
            start_step = resume.position.global_steps_done if resume else 0
            resources = dict(ps=spec.ps, attempt=attempt, start_step=start_step) if spec.ps else {}
            strategy = create_strategy(config, **resources)
            ctx = WorkerContext(rank, world_size, device)
            wrapped = strategy.setup(module, ctx)
            strategy.attach_optimizer(optimizer)
            loss_fn, label_kind = resolve_loss(spec.loss)
            trainer = Trainer(wrapped, optimizer, loss_fn, label_kind, strategy, ctx, groups.control)
            trainer.guard = NanGuard(
                reliability.on_nan_loss, reliability.max_nan_skips, rank, strategy.shares_gradients
            )
            trainer.drill = FaultDrill.parse(reliability.fault_injection)
            trainer.reporter = reporter
            if checkpointer is not None:
                checkpointer.strategy = strategy
                trainer.checkpointer = checkpointer
                trainer.reseed = config.training.seed
                trainer.global_step = start_step
            feed = PartitionFeed(batches, spec.plan, _feed_options(config, rank, device))
            history = _train_epochs(trainer, feed, config, ctx, groups.control, resume)
            state = state_to_bytes(module) if rank == 0 else b""
            return WorkerResult(
                rank,
                feed.cached_rows,
                feed.bad_rows_dropped,
                history,
                state,
                trainer.output_shape or (),
                input_shape=trainer.input_shape or (),
                device={"device": str(device), "gpus": list(gpu_addresses)},
            )
        finally:
            if store is not None:
                store.close()
            if strategy is not None:
                strategy.teardown()
            if feed is not None:
                feed.close()
            groups.destroy()


def _train_epochs(
    trainer: Trainer,
    feed: PartitionFeed,
    config: SparkDLConfig,
    ctx: WorkerContext,
    control: Any,
    resume: Resume | None,
) -> list[dict[str, Any]]:
    history = list(resume.history) if resume else []
    start = resume.position if resume else Position()
    partitions = PartitionInfo([], (0, 1))
    if start.epoch > 1:  # the cache of this attempt is empty: refill it from Spark first
        feed.fill_cache()
        partitions = exchange_partition_info(feed.cached_rows, feed.widths(), ctx, control)
    epochs = config.training.epochs
    for epoch in range(start.epoch, epochs + 1):
        batches, source = feed.epoch(epoch)
        skip = start.epoch_steps_done if epoch == start.epoch else 0
        final = epoch == epochs
        if source == "spark":
            coordinator: StepCoordinator = StreamingCoordinator(control)
        else:
            coordinator = ScheduledCoordinator(
                partitions.counts, config.training.batch_size, partitions.widths
            )
        result = trainer.run_epoch(epoch, batches, coordinator, source, final, skip)
        if source == "spark":
            partitions = exchange_partition_info(feed.cached_rows, feed.widths(), ctx, control)
            if sum(partitions.counts) == 0:
                raise agreed(
                    BadDataError(
                        "the DataFrame given to fit has no rows: every partition was empty. "
                        "Check the filters and joins upstream of fit",
                        bad_rows=0,
                    )
                )
        record = _epoch_record(result)
        if resume is not None and epoch == start.epoch:
            record.update(
                resumed_from_step=start.global_steps_done,
                steps_redone=resume.steps_redone,
                recovery_s=resume.recovered_at - resume.recovery_started,
            )
        history.append(record)
        if trainer.checkpointer is not None:
            trainer.checkpointer.history = history
            trainer.checkpointer.after_epoch(Position(epoch + 1, 0, trainer.global_step))
        log.info(
            "rank %d epoch %d loss %.4f (%d samples, %.2fs)",
            ctx.rank,
            epoch,
            result.loss,
            result.samples,
            result.seconds,
        )
    return history


def _epoch_record(result: EpochResult) -> dict[str, Any]:
    record = asdict(result)
    sync = record.pop("sync")
    record.update(sync)
    record["samples_per_s"] = result.samples / result.seconds if result.seconds > 0 else 0.0
    return record


def _feed_options(config: SparkDLConfig, rank: int, device: torch.device) -> FeedOptions:
    return FeedOptions(
        batch_size=config.training.batch_size,
        shuffle=config.training.shuffle,
        seed=config.training.seed,
        rank=rank,
        prefetch_batches=config.data.prefetch_batches,
        cache_dir=config.data.cache_dir or os.environ.get("SPARK_LOCAL_DIRS", "").split(",")[0],
        pin_memory=device.type == "cuda",
        skip_bad_rows=config.reliability.on_bad_rows is OnError.SKIP,
    )
