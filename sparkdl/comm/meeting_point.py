"""Where a fit's workers meet before their process group exists: a key-value store on the driver.

Spark's barrier ``allGather`` answers by polling every second: 1.0 s per fit whatever the
payload (measured), more than the whole training of a small fit. Each fit instead opens a
``TCPStore`` on the driver, on a listening socket bound to the driver's address with port
0 (no free-port race), and every worker gathers through it once: it puts its message under
its stage attempt's key, waits for the other ranks' keys, and reads them. The same one
call as before carries everything the ranks tell each other before the process group
exists (rank 0's store address, each task's attempt id; :mod:`sparkdl.comm.rendezvous`).

A task cannot see its stage attempt (a re-run stage's tasks look like the first run's),
so the driver, which can, publishes each task's attempt under the task's id
(:meth:`MeetingPointServer.publish`); a worker reads it first, and gathers under it.

Anyone who reaches the driver reaches the store, so every message is signed: an
HMAC-SHA256 under the fit's secret (shipped with the task, like the other endpoints'),
over the stage attempt, the rank and the message. A message the fit's workers did not
write is refused by every reader, so nothing else on the network can send the workers to
another store; it can only make the meeting fail, as it could by cutting the network.
Over Spark Connect there is no driver process of ours, and Spark's ``allGather`` stays.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from sparkdl.comm.rendezvous import AllGather, serve_store
from sparkdl.errors import RendezvousError, RendezvousTimeout

_TAG_CHARS = 2 * hashlib.sha256().digest_size  # hex


@dataclass(frozen=True)
class MeetingPoint:
    """The driver's store for one fit, as the workers reach it.

    Attributes:
        host, port: the store's address (the driver's, as executors reach it).
        secret: the per-fit key every message is signed with.
    """

    host: str
    port: int
    secret: bytes

    def __repr__(self) -> str:  # never print the secret
        return f"MeetingPoint({self.host}:{self.port})"


class MeetingPointServer:
    """The store on the driver, for the length of one fit (a context manager).

    Args:
        host: the driver's address that executors reach; the store listens there only.
        timeout_s: how long the store waits on a connection.
    """

    def __init__(self, host: str, timeout_s: float) -> None:
        store, port = serve_store(host, timeout_s)
        self._store: dist.TCPStore | None = store
        self.endpoint = MeetingPoint(host, port, secrets.token_bytes(32))

    def publish(self, task_id: int, attempt: int) -> None:
        """Tell task ``task_id`` that it runs in stage attempt ``attempt`` (a name: the
        attempt's smallest task id)."""
        assert self._store is not None, "the meeting point is closed"
        self._store.set(_task_key(task_id), _signed(self.endpoint.secret, "task", task_id, str(attempt)))

    def close(self) -> None:
        self._store = None  # its server stops, and its socket closes, with the last reference

    def __enter__(self) -> MeetingPointServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def gather_at(point: MeetingPoint, task_id: int, rank: int, world_size: int, timeout_s: float) -> AllGather:
    """An all-gather of one string per rank through ``point``, among the ranks of task
    ``task_id``'s stage attempt (which the driver publishes).

    Call the result once per worker, as Spark's ``allGather``.

    Raises (from the call):
        RendezvousTimeout: the store was not reached, or a rank did not arrive, in time.
        RendezvousError: a message under a rank's key was not signed by this fit.
    """

    def gather(message: str) -> list[str]:
        try:
            stage, values = _meet(point, task_id, rank, world_size, message, timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # DistStoreError (a timeout among them) derives from it
            raise RendezvousTimeout(
                f"rank {rank}/{world_size}: the workers did not all meet at the driver's store "
                f"{point.host}:{point.port} within {timeout_s:.0f}s ({exc}); check that executors "
                "reach the driver on that address (spark.driver.host) and that every task started, "
                "or raise runtime.collective_timeout_s",
                setting="runtime.collective_timeout_s",
                limit_s=timeout_s,
            ) from exc
        return [_verified(point.secret, stage, r, value) for r, value in enumerate(values)]

    return gather


def _meet(
    point: MeetingPoint, task_id: int, rank: int, world_size: int, message: str, timeout: timedelta
) -> tuple[str, list[bytes]]:
    """Read this task's stage attempt, put ``message`` under it, wait for every rank's,
    read them: the attempt's name and the raw values (one connection, closed after)."""
    store = dist.TCPStore(point.host, point.port, None, is_master=False, timeout=timeout)
    store.wait([_task_key(task_id)], timeout)
    attempt = _verified(
        point.secret, "task", task_id, store.get(_task_key(task_id)), f"task {task_id}'s attempt"
    )
    stage = f"attempt-{attempt}"
    keys = [f"{stage}/{r}" for r in range(world_size)]
    store.set(keys[rank], _signed(point.secret, stage, rank, message))
    store.wait(keys, timeout)
    return stage, list(store.multi_get(keys))


def _task_key(task_id: int) -> str:
    return f"task/{task_id}"


def _signed(secret: bytes, stage: str, rank: int, body: str) -> str:
    """``body`` behind its tag (hex: the store keeps text)."""
    return _tag(secret, stage, rank, body.encode()) + body


def _verified(secret: bytes, stage: str, rank: int, value: bytes, what: str = "") -> str:
    tag, body = value[:_TAG_CHARS], value[_TAG_CHARS:]
    if len(value) < _TAG_CHARS or not hmac.compare_digest(tag, _tag(secret, stage, rank, body).encode()):
        raise RendezvousError(
            f"{what or f'the message of rank {rank}'} at the driver's meeting point ({len(value)} bytes) "
            "is not signed by this fit: another process on the network wrote it. "
            "The fit stops rather than trust it; keep the driver's ports reachable from the "
            "executors only"
        )
    return body.decode()


def _tag(secret: bytes, stage: str, rank: int, body: bytes) -> str:
    return hmac.new(secret, f"sparkdl meeting\0{stage}\0{rank}\0".encode() + body, hashlib.sha256).hexdigest()
