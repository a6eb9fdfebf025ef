"""Forming the torch.distributed process group inside a barrier stage.

The ranks meet in a ``TCPStore`` on the driver (:class:`RendezvousHost`, one per fit,
listening on the driver's address for the length of the stage): each rank connects to
it, writes its task attempt id under its stage attempt's prefix, and reads everyone's
(the smallest names the stage attempt, the same on every rank); the process group then
forms through the same store. A retried stage attempt meets under a new prefix. Every
wait has a deadline.

Without a driver the executors can reach (a Spark Connect client) the ranks meet
through the barrier's ``allGather`` instead: rank 0 binds a listening socket on its own
host with port 0 (the OS picks a free port; no "find a free port, close it, rebind"
race), hands it to a ``TCPStore`` and publishes ``host:port``. That costs a second a
fit: Spark answers ``allGather`` by polling every second (measured: 1.0 s per call,
whatever the payload), which is why the driver's store comes first.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from sparkdl.errors import RendezvousError

log = logging.getLogger(__name__)

AllGather = Callable[[str], list[str]]


@dataclass(frozen=True)
class RendezvousEndpoint:
    """The driver's rendezvous store (shipped inside the task spec)."""

    host: str
    port: int


class RendezvousHost:
    """The driver's ``TCPStore`` for one fit, bound to ``host`` (the driver's address that
    executors reach), until :meth:`close`."""

    def __init__(self, host: str, timeout_s: float) -> None:
        self._listener: socket.socket | None = socket.create_server((host, 0), backlog=128)
        port = self._listener.getsockname()[1]
        self._store: dist.TCPStore | None = dist.TCPStore(
            host,
            port,
            None,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=self._listener.fileno(),
        )
        self.endpoint = RendezvousEndpoint(host, port)

    def close(self) -> None:
        self._store = None  # the store's server stops with its last reference
        if self._listener is not None:
            self._listener.close()
            self._listener = None


@dataclass
class ProcessGroups:
    """The default group (gloo or NCCL) and a gloo group for small CPU control messages."""

    store: dist.Store
    control: dist.ProcessGroup | None
    listener: socket.socket | None
    attempt: int = 0  # the stage attempt: the smallest task attempt id, the same on every rank

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.listener is not None:
            self.listener.close()


def form_process_group(
    rank: int,
    world_size: int,
    host: str,
    backend: str,
    all_gather: AllGather,
    timeout_s: float,
    task_attempt: int = 0,
    driver: RendezvousEndpoint | None = None,
    stage: str = "",
) -> ProcessGroups:
    """Create the default process group; return it with a gloo control group.

    Args:
        rank: this worker's rank (its barrier partition id).
        world_size: number of workers.
        host: the address of this worker's host that the others can reach.
        backend: "gloo" or "nccl".
        all_gather: the barrier's allGather (every rank calls it once, in step), used only
            without ``driver``.
        timeout_s: deadline for connecting and for every later collective.
        task_attempt: this task's attempt id (Spark's ``taskAttemptId``), unique per task.
        driver: the driver's rendezvous store (None: meet through ``all_gather``).
        stage: the stage attempt ("stage id.attempt number"), the prefix of its keys there.

    Raises:
        RendezvousError: the store could not be created or reached in time.
    """
    timeout = timedelta(seconds=timeout_s)
    listener = None
    if driver is not None:
        where = f"the driver's rendezvous store at {driver.host}:{driver.port}"
        try:
            store, attempt = _meet_at_driver(driver, stage, rank, world_size, task_attempt, timeout)
        except RuntimeError as exc:  # DistStoreError derives from it
            raise RendezvousError(
                f"rank {rank}/{world_size}: could not meet the other workers at {where} within "
                f"{timeout_s:.0f}s ({exc}); executors must reach the driver's address "
                "(spark.driver.host), or raise runtime.collective_timeout_s"
            ) from exc
    else:
        said: dict[str, object] = {"attempt": task_attempt}
        if rank == 0:
            listener = socket.create_server((host, 0), backlog=max(world_size, 16))
            said.update(host=host, port=listener.getsockname()[1])
        messages = [json.loads(m) for m in all_gather(json.dumps(said))]
        address = messages[0]
        where = f"rank 0's store at {address['host']}:{address['port']}"
        attempt = min(int(m["attempt"]) for m in messages)
    try:
        if driver is None:
            store = dist.TCPStore(
                address["host"],
                address["port"],
                world_size,
                is_master=rank == 0,
                timeout=timeout,
                wait_for_workers=False,
                master_listen_fd=listener.fileno() if listener is not None else None,
            )
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    except RuntimeError as exc:  # DistStoreError and DistBackendError derive from it
        if listener is not None:
            listener.close()
        raise RendezvousError(
            f"rank {rank}/{world_size}: could not form the {backend} process group through "
            f"{where} within {timeout_s:.0f}s ({exc}); check that executors can reach each "
            "other, set runtime.network_interface, or raise runtime.collective_timeout_s"
        ) from exc
    log.info("rank %d joined %s process group of %d via %s", rank, backend, world_size, where)
    return ProcessGroups(store=store, control=control, listener=listener, attempt=attempt)


def _meet_at_driver(
    driver: RendezvousEndpoint, stage: str, rank: int, world_size: int, task_attempt: int, timeout: timedelta
) -> tuple[dist.Store, int]:
    """This stage attempt's view of the driver's store, and the stage attempt's id (the
    smallest task attempt id of its ranks, as every rank reads it)."""
    client = dist.TCPStore(
        driver.host, driver.port, None, is_master=False, timeout=timeout, wait_for_workers=False
    )
    store = dist.PrefixStore(f"stage-{stage}/", client)
    store.set(f"attempt/{rank}", str(task_attempt))
    keys = [f"attempt/{r}" for r in range(world_size)]
    store.wait(keys)
    return store, min(int(v) for v in store.multi_get(keys))
