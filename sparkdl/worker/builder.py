"""How every worker starts and is built, whichever entry point runs it.

fit's worker (:mod:`sparkdl.worker.assembly`), a user's own loop
(:mod:`sparkdl.worker.own_loop`, :mod:`sparkdl.worker.prepare`) and the advisor's probe
(:mod:`sparkdl.worker.probe`) start the same way (:func:`start_worker`: the teardown
watchdog, the network interface, the device, the process groups and hierarchy, the
progress reporter, the seed) and build a model under a strategy the same way
(:class:`Builder`: module -> exchange -> context -> strategy), so that a strategy, an
exchange or a fix reaches every one of them.

Teardown (the caller's exit stack, in reverse of the start): the watchdog is disarmed last
but one, after the process groups are released; the progress reporter closes last of all,
so that an error in the teardown still reaches the driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sparkdl.comm.exchange import Exchange
from sparkdl.comm.forming import Where, form_exchange, form_hierarchy
from sparkdl.comm.hierarchy import HostGroups
from sparkdl.comm.ps_endpoint import PsEndpoint
from sparkdl.comm.rendezvous import AllGather, ProcessGroups, form_process_group
from sparkdl.config import SparkDLConfig
from sparkdl.services.progress.channel import (
    HeldRecords,
    ProgressEndpoint,
    ProgressReporter,
    reporting_to_driver,
)
from sparkdl.strategies import StrategyContext, SyncStrategy, create_strategy, strategy_class
from sparkdl.training.schedules import CONSTANT_LR, LrPlan
from sparkdl.training.strategy import SchedulerFn
from sparkdl.worker.device import choose_backend, choose_device
from sparkdl.worker.teardown import TeardownWatchdog, close_strategy, release_process_groups, socket_interface

#: A worker that has said nothing for this long sends the driver a heartbeat.
HEARTBEAT_S = 5.0


@dataclass(frozen=True)
class Placement:
    """Where one worker runs, as its barrier task sees it."""

    rank: int
    world_size: int
    host: str  # this worker's address that the others can reach
    gpu_addresses: tuple[str, ...] = ()
    torch_threads: int = 1
    task_attempt: int = 0  # Spark's taskAttemptId; the smallest over the ranks names the stage attempt
    peers: tuple[str, ...] = ()  # every rank's executor address ("host:port"), by rank


@dataclass(frozen=True)
class Started:
    """A worker that met the others.

    Attributes:
        watchdog: bounds the teardown once armed (the caller arms it when assembled).
        where: this worker's rank, world, peers and device.
        groups: the process groups the workers formed.
        hierarchy: the two levels of ``runtime.hierarchy`` (None: flat).
        reporter: the driver's progress channel (None where the driver does not listen).
    """

    watchdog: TeardownWatchdog
    where: Where
    groups: ProcessGroups
    hierarchy: HostGroups | None
    reporter: ProgressReporter | None

    @property
    def device(self) -> torch.device:
        return self.where.device


def start_worker(
    config: SparkDLConfig,
    placement: Placement,
    all_gather: AllGather,
    progress: ProgressEndpoint | None,
    stack: contextlib.ExitStack,
) -> Started:
    """The start every worker shares: meet the others (:func:`join_peers`), then open the
    progress channel (records logged before it could open, such as the device's warnings,
    go to it then), and seed torch with ``training.seed``. ``stack`` owns all of it."""
    last_out = stack.enter_context(contextlib.ExitStack())  # the reporter, once it can start
    held = stack.enter_context(HeldRecords())
    watchdog, device, groups, hierarchy = join_peers(config, placement, all_gather, stack)
    reporter = last_out.enter_context(
        reporting_to_driver(progress, placement.rank, groups.attempt, heartbeat_s=HEARTBEAT_S)
    )
    held.send_to(reporter)
    torch.manual_seed(config.training.seed)
    where = Where(placement.rank, placement.world_size, placement.peers, device)
    return Started(watchdog, where, groups, hierarchy, reporter)


def join_peers(
    config: SparkDLConfig, placement: Placement, all_gather: AllGather, stack: contextlib.ExitStack
) -> tuple[TeardownWatchdog, torch.device, ProcessGroups, HostGroups | None]:
    """The teardown watchdog (disarmed on the way out; the caller arms it once assembled),
    the network interface of the executor's address, the device and process groups, the
    hierarchy."""
    watchdog = TeardownWatchdog(config.runtime.teardown_timeout_s, placement.rank)
    stack.callback(watchdog.disarm)
    stack.enter_context(socket_interface(config.runtime.network_interface, placement.host))
    device, groups = join(config, placement, all_gather, stack)
    where = Where(placement.rank, placement.world_size, placement.peers, device)
    return watchdog, device, groups, form_hierarchy(config.runtime, where)


def join(
    config: SparkDLConfig, placement: Placement, all_gather: AllGather, stack: contextlib.ExitStack
) -> tuple[torch.device, ProcessGroups]:
    """This worker's device, and the process groups it forms with the others."""
    torch.set_num_threads(placement.torch_threads)
    device = choose_device(
        config.runtime.use_gpu, list(placement.gpu_addresses), torch.cuda.device_count(), placement.rank
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = form_process_group(
        placement.rank,
        placement.world_size,
        placement.host,
        choose_backend(config.runtime.backend, device),
        all_gather,
        config.runtime.collective_timeout_s,
        placement.task_attempt,
    )
    stack.callback(release_process_groups, groups)
    return device, groups


@dataclass(frozen=True)
class Builder:
    """Builds a model under ``config``'s strategy on one worker: the module, its exchange
    with the other workers, the strategy over it and its optimizer; ``stack`` closes what
    it builds.

    Attributes:
        config: the settings the model trains under (a probed candidate's, in the advisor).
        where, groups, hierarchy: the worker, as :func:`start_worker` found it.
        stack: owns the exchanges and strategies built.
    """

    config: SparkDLConfig
    where: Where
    groups: ProcessGroups
    hierarchy: HostGroups | None
    stack: contextlib.ExitStack

    @property
    def kind(self) -> type[SyncStrategy]:
        return strategy_class(self.config.training.strategy)

    def module(
        self, model_fn: Callable[[], nn.Module], parallelize_fn: Callable[[nn.Module, Any], object] | None
    ) -> nn.Module:
        """``model_fn``'s model on this worker's device, as the strategy builds it (its shards,
        its stage), ready for the optimizer."""
        return self.kind.build_module(model_fn, self.config, self.where.device, parallelize_fn)

    def exchange(self, module: nn.Module) -> Exchange:
        """The door of ``module``'s sums with the other workers (the process group with the
        run's compression, one host's shared memory, or two levels)."""
        exchange = form_exchange(
            self.config.runtime,
            self.where,
            self.groups,
            payload_bytes(module),
            self.kind.plain_sum,
            self.hierarchy,
        )
        self.stack.callback(exchange.close)
        return exchange

    def strategy(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        exchange: Exchange,
        *,
        ps: PsEndpoint | None = None,
        start_step: int = 0,
        lr: LrPlan = CONSTANT_LR,
        scheduler_fn: SchedulerFn | None = None,
        resumed_state: Mapping[str, Any] | None = None,
    ) -> SyncStrategy:
        """The strategy over ``module`` and ``optimizer``, starting at global step
        ``start_step`` (with its own entries of the checkpoint the run resumed from)."""
        where = self.where
        context = StrategyContext(
            config=self.config,
            rank=where.rank,
            world_size=where.world_size,
            device=where.device,
            module=module,
            optimizer=optimizer,
            control_group=self.groups.control,
            ps=ps,
            attempt=self.groups.attempt,
            resume_step=start_step,
            lr=lr,
            scheduler_fn=scheduler_fn,
            store=self.groups.store,
            exchange=exchange,
            resumed_state=resumed_state or {},
        )
        strategy = create_strategy(context)
        self.stack.callback(close_strategy, strategy)
        return strategy


def payload_bytes(module: nn.Module) -> int:
    """What one sum of every trainable parameter weighs (sizes a shared-memory segment; the
    frozen ones are never summed: :mod:`sparkdl.strategies.trainable`)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
