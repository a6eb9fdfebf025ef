"""Choosing a worker's exchange, once, when the worker is assembled: where it runs
(:class:`Where`), the two levels of ``runtime.hierarchy`` (:func:`form_hierarchy`), and the
exchange itself (:func:`form_exchange`, :mod:`sparkdl.comm.exchange`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sparkdl.comm.exchange import Exchange, FlatExchange, HierarchicalExchange, HostMemoryExchange
from sparkdl.comm.hierarchy import HostGroups, host_key
from sparkdl.comm.rendezvous import ProcessGroups
from sparkdl.comm.shared_memory import form_host_group
from sparkdl.config import Compression, RuntimeConfig
from sparkdl.config import Hierarchy as HierarchyLevel
from sparkdl.errors import ClusterConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Where:
    """Where one worker runs, as far as the exchange cares.

    Attributes:
        rank, world_size: this worker and the world.
        peers: every rank's executor address ("host:port"), by rank (for ``runtime.hierarchy``).
        device: the worker's device (shared memory serves CPUs only).
    """

    rank: int
    world_size: int
    peers: tuple[str, ...]
    device: torch.device


def form_exchange(
    runtime: RuntimeConfig,
    where: Where,
    groups: ProcessGroups,
    payload_bytes: int,
    plain_sum: bool,
    hierarchy: HostGroups | None = None,
) -> Exchange:
    """Choose and form this worker's exchange; the same choice on every rank (collective over
    the control group where shared memory is formed).

    Args:
        runtime: the run's ``[runtime]`` settings.
        where: this worker's place.
        groups: the process groups the workers formed.
        payload_bytes: what one sum of the model weighs (sizes the shared segment).
        plain_sum: whether the strategy's exchange is a plain sum of float tensors that one
            host's shared memory can carry (all-reduce, weight averaging).
        hierarchy: the two levels :func:`form_hierarchy` formed (None: flat).
    """
    shared_ok = runtime.shared_memory and where.device.type == "cpu" and where.world_size > 1
    if hierarchy is not None:
        if shared_ok:
            hierarchy.share_memory(payload_bytes, runtime.collective_timeout_s)
        return HierarchicalExchange(hierarchy, where.world_size, groups.control)
    if shared_ok and plain_sum and runtime.compression is Compression.NONE:
        shared = form_host_group(
            where.rank, where.world_size, groups.control, payload_bytes, runtime.collective_timeout_s
        )
        if shared is not None:
            return HostMemoryExchange(shared, where.world_size, groups.control)
    on_cpu = where.device.type == "cpu"
    return FlatExchange(where.world_size, groups.control, runtime, on_cpu, successor_elsewhere(where))


def successor_elsewhere(where: Where) -> bool:
    """Whether the next rank of a ring (``rank + 1`` mod the world) runs on another host than
    this one (False where the addresses are unknown)."""
    if len(where.peers) != where.world_size or where.world_size < 2:
        return False
    successor = where.peers[(where.rank + 1) % where.world_size]
    return host_key(where.peers[where.rank], HierarchyLevel.HOST) != host_key(successor, HierarchyLevel.HOST)


def form_hierarchy(runtime: RuntimeConfig, where: Where) -> HostGroups | None:
    """The two levels of ``runtime.hierarchy`` (None: flat, or nothing to gain from two); their
    process groups, formed by every rank in step, serve every exchange of the worker."""
    level = runtime.hierarchy
    if level is HierarchyLevel.NONE:
        return None
    if len(where.peers) != where.world_size:
        raise ClusterConfigError(
            f"runtime.hierarchy = {level.value!r} needs every task's address; this worker got "
            f"{len(where.peers)} for {where.world_size} ranks"
        )
    keys = [host_key(address, level) for address in where.peers]
    hierarchy = HostGroups.build(keys, where.rank, runtime.collective_timeout_s)
    if hierarchy is not None:
        log.info(
            "rank %d: host %d of %d, led by rank %d",
            where.rank,
            hierarchy.host,
            hierarchy.hosts,
            hierarchy.leader,
        )
    return hierarchy
