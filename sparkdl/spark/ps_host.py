"""Hosting the parameter server inside the driver process for the length of one ``fit``."""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from sparkdl.comm.factors import factorable
from sparkdl.comm.ps_endpoint import PsEndpoint
from sparkdl.config import OptimizerName, PsMode, SparkDLConfig, SufficientFactors
from sparkdl.errors import ClusterConfigError
from sparkdl.services.ps.factored import FactorLayout
from sparkdl.services.ps.full_batch import Coordinator, ShardedVectors
from sparkdl.services.ps.server import ParameterServer
from sparkdl.services.ps.sharding import shard_trainable
from sparkdl.services.ps.store import ShardStore
from sparkdl.spark.cluster import driver_host, executor_addresses, is_connect
from sparkdl.storage.filesystems import PathWithOptions
from sparkdl.training.factory import OptimizerFn, build_model, build_optimizer
from sparkdl.training.full_batch_settings import lbfgs_settings
from sparkdl.training.schedules import CONSTANT_LR, LrPlan
from sparkdl.training.strategy import SchedulerFn
from sparkdl.worker.assembly import TrainSpec

log = logging.getLogger(__name__)


@dataclasses.dataclass
class HostedServer:
    server: ParameterServer
    model: nn.Module  # its parameters are the shards' authoritative weights
    spec: TrainSpec  # the task spec, now carrying the endpoint and secret
    coordinator: Coordinator | None = None  # optimizer lbfgs: L-BFGS over the shards' vectors

    def parameter_state(self) -> dict[str, torch.Tensor]:
        """The server's weights by state-dict key: the trainable parameters it served (buffers
        and frozen parameters are not served: rank 0's are kept)."""
        names = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return {k: v.detach().clone() for k, v in self.model.state_dict().items() if k in names}

    def stop(self) -> None:
        if self.coordinator is not None:
            self.coordinator.stop()
        self.server.stop()


def start_parameter_server(
    spark: Any,
    spec: TrainSpec,
    attempt_started: Callable[[int], bool] | None = None,
    task_started: Callable[[int, int], bool] | None = None,
) -> HostedServer:
    """Build the initial model, split its trainable parameters into shards and serve them on
    the driver's address.

    A fresh 32-byte secret authenticates every frame of this fit; it travels to the
    executors inside the task spec, never in SparkConf (which the UI and event log show).

    Raises:
        ClusterConfigError: the session is a Spark Connect client (its driver process is
            not ours to host a server in).
    """
    if is_connect(spark):
        raise ClusterConfigError(
            "strategy 'parameter_server' hosts its server in the Spark driver process, which a "
            "Spark Connect client cannot run code in; use strategy 'allreduce' or "
            "'weight_averaging' with Spark Connect"
        )
    return host_parameter_server(spec, driver_host(spark), attempt_started, task_started)


def _steps_per_version(config: SparkDLConfig) -> float:
    """Global steps one server version stands for: one in a barrier stage's sync and ssp (a
    version is a clock every worker pushed); where each push is a version (async, and every
    mode of independent tasks) a worker pushes every ``push_interval`` of its steps, so N
    workers make N versions per push_interval steps."""
    settings = config.parameter_server
    if settings.ps_mode is not PsMode.ASYNC and settings.ps_barrier:
        return 1.0
    return settings.push_interval / config.training.num_workers


def _shared_memory_bytes(config: SparkDLConfig) -> int:
    """How much shared memory the server may give workers on its host (0: none)."""
    if not config.runtime.shared_memory:
        return 0
    return int(config.parameter_server.ps_shared_memory_mb * 1024 * 1024)


def host_parameter_server(
    spec: TrainSpec,
    host: str,
    attempt_started: Callable[[int], bool] | None = None,
    task_started: Callable[[int, int], bool] | None = None,
) -> HostedServer:
    """Start the server for ``spec`` on ``host`` (port chosen by the OS); a HELLO of a stage
    attempt is believed when ``attempt_started`` says Spark runs it, an independent task's
    when ``task_started`` does (None: any)."""
    server, model, endpoint, coordinator = _serve(
        spec.config, spec.model_fn, spec.optimizer_fn, host, attempt_started, spec.lr, spec.scheduler_fn,
        task_started,
    )  # fmt: skip
    if coordinator is not None:
        coordinator.start()
    return HostedServer(server, model, dataclasses.replace(spec, ps=endpoint), coordinator)


def serve_parameters(
    config: SparkDLConfig,
    model_fn: Callable[[], nn.Module],
    optimizer_fn: OptimizerFn | None,
    host: str,
    attempt_started: Callable[[int], bool] | None = None,
    lr: LrPlan = CONSTANT_LR,
    scheduler_fn: SchedulerFn | None = None,
) -> tuple[ParameterServer, nn.Module, PsEndpoint]:
    """Build the initial model with ``model_fn`` (seeded with ``training.seed``), split its
    trainable parameters into shards, and serve them on ``host`` with ``optimizer_fn``'s
    optimizer (or the ``[optimizer]`` settings'): the server, its model, and the endpoint for
    the workers."""
    server, model, endpoint, _ = _serve(
        config, model_fn, optimizer_fn, host, attempt_started, lr, scheduler_fn
    )
    return server, model, endpoint


def _serve(
    config: SparkDLConfig,
    model_fn: Callable[[], nn.Module],
    optimizer_fn: OptimizerFn | None,
    host: str,
    attempt_started: Callable[[int], bool] | None,
    lr: LrPlan,
    scheduler_fn: SchedulerFn | None,
    task_started: Callable[[int, int], bool] | None = None,
) -> tuple[ParameterServer, nn.Module, PsEndpoint, Coordinator | None]:
    """:func:`serve_parameters`, and with ``optimizer = "lbfgs"`` the coordinator (not yet
    started) whose shards hold the L-BFGS vectors instead of an optimizer."""
    torch.manual_seed(config.training.seed)
    model = build_model(model_fn)
    params = list(model.parameters())
    independent = not config.parameter_server.ps_barrier  # one shard: its row count is the partition's
    shards = 1 if independent else config.parameter_server.ps_shards
    groups = shard_trainable(params, shards)  # the frozen stay on the workers
    vectors = (
        ShardedVectors(config.optimizer.weight_decay)
        if config.optimizer.optimizer is OptimizerName.LBFGS
        else None
    )
    stores = _shard_stores(config, params, groups, optimizer_fn, lr, scheduler_fn, vectors)
    coordinator = None
    if vectors is not None:  # Sandblaster: the driver coordinates, the shards hold the vectors
        vectors.attach(stores)
        coordinator = Coordinator(vectors, stores, lbfgs_settings(config))
    layouts = None
    if config.runtime.sufficient_factors is not SufficientFactors.OFF:
        shapes = {id(layer.weight): (layer.in_features, layer.out_features) for _, layer in factorable(model)}
        layouts = [FactorLayout.of([params[i] for i in group], shapes) for group in groups]
    server = ParameterServer(
        stores,
        host,
        secrets.token_bytes(32),
        config.parameter_server.ps_timeout_s,
        int(config.parameter_server.ps_max_frame_mb * 1024 * 1024),
        # the path carries the storage options to the server's snapshot stores
        snapshot_dir=PathWithOptions(config.reliability.checkpoint_dir, config.reliability.storage_options),
        encrypt=config.runtime.encrypt,
        attempt_started=attempt_started,
        # a connection per shard per worker, twice over while a failed attempt's close
        max_sessions=2 * config.training.num_workers * len(stores) + 16,
        topk_ratio=config.runtime.topk_ratio,
        torch_threads=config.parameter_server.ps_torch_threads,
        shared_memory_bytes=_shared_memory_bytes(config),
        factor_layouts=layouts,
        attempt_lock=vectors.attempt_lock if vectors is not None else None,
        known=executor_addresses(),
        task_started=task_started,
    )
    log.info(
        "parameter server for %d workers on %s:%d, %d shards, %s",
        config.training.num_workers,
        server.host,
        server.port,
        len(stores),
        f"shared memory for workers on its host ({server.areas.info.slots} areas)"
        if server.areas is not None
        else "no shared memory",
    )
    return server, model, server.endpoint(tuple(tuple(g) for g in groups)), coordinator


def _shard_stores(
    config: SparkDLConfig,
    params: list[nn.Parameter],
    groups: list[list[int]],
    optimizer_fn: OptimizerFn | None,
    lr: LrPlan,
    scheduler_fn: SchedulerFn | None,
    vectors: ShardedVectors | None,
) -> list[ShardStore]:
    """One store per shard of ``params``: its optimizer (``optimizer_fn``'s, or the
    ``[optimizer]`` settings'), or with L-BFGS none (the shards hold its ``vectors``)."""

    def shard_optimizer(shard: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return build_optimizer(shard, optimizer_fn, config.optimizer)

    settings = config.parameter_server
    return [
        ShardStore(
            [params[i] for i in group],
            None if vectors is not None else shard_optimizer,
            settings.ps_mode,
            config.training.num_workers,
            settings.staleness,
            lr=lr,
            scheduler_fn=scheduler_fn,
            steps_per_version=_steps_per_version(config),
            backup_workers=settings.backup_workers,
            handoff=vectors.receive if vectors is not None else None,
            independent=not settings.ps_barrier,
        )
        for group in groups
    ]
