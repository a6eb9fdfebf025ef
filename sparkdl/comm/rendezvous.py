"""Forming the torch.distributed process group inside a barrier stage.

Rank 0 binds a listening socket on its own host with port 0 (the OS picks a free
port; no "find a free port, close it, rebind" race) and hands that socket to a
``TCPStore``. It publishes ``host:port`` through an all-gather; the other ranks
connect to it. Every wait has a deadline.

The all-gather is called exactly once per worker, and everything the ranks must tell
each other before the process group exists travels in that one call (the store's
address, and each task's attempt id, which names the stage attempt); anything later
goes over the process group. It is the driver's meeting point
(:mod:`sparkdl.services.meeting.server`), or Spark's barrier ``allGather``, which answers by
polling every second (measured: 1.0 s per call, whatever the payload).
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from sparkdl.errors import RendezvousError, RendezvousTimeout

log = logging.getLogger(__name__)

AllGather = Callable[[str], list[str]]

#: The longest one probe of a peer may wait (a dropped SYN; a refusal is at once).
_PROBE_S = 10.0


@dataclass
class ProcessGroups:
    """The default group (gloo or NCCL) and a gloo group for small CPU control messages.
    Rank 0's store owns its listening socket and closes it when the store is released."""

    store: dist.TCPStore
    control: dist.ProcessGroup | None
    attempt: int = 0  # the stage attempt: the smallest task attempt id, the same on every rank

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def form_process_group(
    rank: int,
    world_size: int,
    host: str,
    backend: str,
    all_gather: AllGather,
    timeout_s: float,
    task_attempt: int = 0,
) -> ProcessGroups:
    """Create the default process group; return it with a gloo control group.

    Args:
        rank: this worker's rank (its barrier partition id).
        world_size: number of workers.
        host: the address of this worker's host that the others can reach.
        backend: "gloo" or "nccl".
        all_gather: the barrier's allGather (every rank calls it once, in step).
        timeout_s: deadline for connecting and for every later collective.
        task_attempt: this task's attempt id (Spark's ``taskAttemptId``), unique per task.

    Raises:
        RendezvousError: a rank cannot reach another (:func:`probe_peers`), in seconds.
        RendezvousTimeout: the store could not be created or reached in time.
    """
    timeout = timedelta(seconds=timeout_s)
    listener = None
    said: dict[str, object] = {}
    if rank == 0:
        listener = socket.create_server((host, 0), backlog=max(world_size, 16))
        said.update(host=host, port=listener.getsockname()[1])
    try:
        messages, attempt, probe = meet_peers(
            rank, world_size, host, all_gather, task_attempt, said, timeout_s
        )
        with probe:  # open until the group exists: every rank has probed by then
            return _formed(rank, world_size, backend, messages[0], attempt, listener, timeout, timeout_s)
    except BaseException:
        if listener is not None:
            listener.close()
        raise


def meet_peers(
    rank: int,
    world_size: int,
    host: str,
    all_gather: AllGather,
    task_attempt: int,
    said: dict[str, object],
    timeout_s: float,
) -> tuple[list[dict[str, Any]], int, socket.socket]:
    """The one all-gather before anything else exists: every rank says ``said`` (with its
    task attempt and a probe address), then connects once to every other rank's probe, so
    that a rank another cannot reach fails in seconds. Returns every rank's message, the
    stage attempt (the smallest task attempt id, the same on every rank), and this rank's
    probe socket: the caller closes it once every rank is known to have probed (its process
    group, or its next collective, formed).

    Raises:
        RendezvousError: a rank cannot reach another (:func:`probe_peers`).
    """
    probe = socket.create_server((host, 0), backlog=max(world_size, 16))
    try:
        message = {**said, "attempt": task_attempt, "probe": [host, probe.getsockname()[1]]}
        messages = [json.loads(m) for m in all_gather(json.dumps(message))]
        probe_peers(rank, host, [tuple(m["probe"]) for m in messages], min(timeout_s, _PROBE_S))
    except BaseException:
        probe.close()
        raise
    return messages, min(int(m["attempt"]) for m in messages), probe


def _formed(
    rank: int,
    world_size: int,
    backend: str,
    address: dict[str, Any],
    attempt: int,
    listener: socket.socket | None,
    timeout: timedelta,
    timeout_s: float,
) -> ProcessGroups:
    """The process group, formed through rank 0's store (its ``address``)."""
    try:
        store = dist.TCPStore(
            address["host"],
            address["port"],
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listener.fileno() if listener is not None else None,
        )
        if listener is not None:
            # the store owns the socket now and closes it when released: a second owner
            # would close the number again, later, under whatever socket reuses it (a
            # later fit's store in a reused Python worker, once a cycle held this one)
            listener.detach()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    except RuntimeError as exc:  # DistStoreError and DistBackendError derive from it
        raise RendezvousTimeout(  # form_process_group closes the listener
            f"rank {rank}/{world_size}: could not form the {backend} process group through "
            f"{address['host']}:{address['port']} within {timeout_s:.0f}s ({exc}); check that "
            "executors can reach each other on that address, set runtime.network_interface, "
            "or raise runtime.collective_timeout_s",
            setting="runtime.collective_timeout_s",
            limit_s=timeout_s,
        ) from exc
    log.info("rank %d joined %s process group of %d via %s", rank, backend, world_size, address)
    return ProcessGroups(store=store, control=control, attempt=attempt)


def serve_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """A ``TCPStore`` server on ``host``, on a socket bound with port 0 before the store takes
    it (no "find a free port, close it, rebind" race); the store and its port. The store owns
    the socket, and closes it when it is released."""
    listener = socket.create_server((host, 0), backlog=128)
    port = listener.getsockname()[1]
    fd = listener.detach()
    try:
        store = dist.TCPStore(
            host,
            port,
            None,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise
    return store, port


def probe_peers(rank: int, host: str, peers: list[tuple[str, int]], timeout_s: float) -> None:
    """Connect once to every other rank's probe socket: a rank another cannot reach (a
    firewall, a wrong address or interface) fails here in seconds, naming both ends,
    instead of in the process group after the collective timeout.

    Raises:
        RendezvousError: ``peers[r]`` refused or did not answer within ``timeout_s``.
    """
    for peer, (address, port) in enumerate(peers):
        if peer == rank:
            continue
        try:
            socket.create_connection((address, port), timeout=timeout_s).close()
        except OSError as exc:
            raise RendezvousError(
                f"rank {rank} at {host} cannot reach rank {peer} at {address}:{port} ({exc}); the "
                f"process group would fail after runtime.collective_timeout_s. Check that the "
                "executors can reach each other on these addresses (firewalls, routes), or set "
                "runtime.network_interface to the interface they share"
            ) from exc
