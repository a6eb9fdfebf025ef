"""The parameter server's socket side: one listening socket on the driver, a thread per
worker connection, shards served in parallel (each shard has its own lock).

This module hosts the server and owns its lifetime: it binds the port, makes the shared
memory, and wires the pieces that serve the workers; :meth:`ParameterServer.stop` ends
them all in bounded time. The pieces, each in its module:

- :mod:`~sparkdl.services.ps.sessions`: one worker connection from its authenticated HELLO
  (bound to one rank and one stage attempt) to its end; frames that break the protocol
  close it, the other workers are not affected.
- :mod:`~sparkdl.services.ps.handling`: the answer to each request (PUSH, PULL, ABORT,
  SNAPSHOT), or an ERROR frame whose code names the error; rejected pushes are counted.
- :mod:`~sparkdl.services.ps.parking`: pulls through shared memory that must wait, parked
  and answered by the push that makes them answerable (:data:`PARK_MAX_VALUES`), and the
  locks that keep one sender at a time on a channel.
- :mod:`~sparkdl.services.ps.served_attempt`: which stage attempt the shards serve (a newer one
  believed only when Spark started it), and the shards' snapshots for a resume.
- :mod:`~sparkdl.services.ps.connection`: what a connection keeps between its requests.
- :mod:`~sparkdl.services.ps.store`: the shards themselves, pure (no sockets).

Shared memory. Workers on the driver's own host may ask, in their HELLO, for an area of
the server's shared memory (:mod:`sparkdl.comm.ps_areas`); their PUSH and WEIGHTS payloads
then go through it, and only the authenticated headers cross the socket. The areas are made
once the port is bound, as many as ``shared_memory_bytes`` hold.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable, Container, Iterable, Iterator, Sequence

import torch

from sparkdl.comm.compression.codecs import Codec, push_codecs
from sparkdl.comm.ps_areas import ServerAreas, shared_memory_supported, slot_bytes
from sparkdl.comm.ps_endpoint import PsEndpoint
from sparkdl.services.ps.connection import Waiting, WarmBuffers
from sparkdl.services.ps.factored import FactorLayout
from sparkdl.services.ps.handling import RequestHandler, all_finite
from sparkdl.services.ps.protocol import MAX_ERROR_BYTES, PS_WIRE, Frame, PsChannel
from sparkdl.services.ps.served_attempt import StageAttempts
from sparkdl.services.ps.sessions import Sessions
from sparkdl.services.ps.store import ShardStore
from sparkdl.wire.listener import ConnectionListener

log = logging.getLogger(__name__)

#: A pull through shared memory that must wait is parked when its shard holds at most this
#: many values: the push that completes its clock answers it, and its connection's thread is
#: not woken (on the strategies benchmark's 85k-value shard that saved a wake-up, a
#: condition wait and the threads' turns at the GIL, per worker and step: 0.54 to 0.73 of
#: all-reduce's samples/s). The thread that answers copies every waiting worker's weights,
#: one after the other (85k values: 10 us a copy); at this size a copy costs about what it
#: saves, and for a larger shard each connection's thread copies its own, in parallel.
#: Read when a server is made (the parked-pulls benchmark and the tests switch it here).
PARK_MAX_VALUES = 1 << 18

# What the tests reach for under the names they had before the server was split.
_Waiting = Waiting
_WarmBuffers = WarmBuffers
_all_finite = all_finite


#: How long stopping waits for the requests being answered to finish (a pull that waited,
#: woken by the stop, sends its worker the reason): a moment, whatever the stop's own bound.
_ANSWER_DRAIN_S = 2.0


class ParameterServer:
    """Serves ``stores`` on ``(host, port 0)`` until :meth:`stop`.

    Args:
        stores: one :class:`ShardStore` per shard.
        host: address to bind (the driver's address that executors reach).
        secret: per-fit HMAC key.
        timeout_s: how long a pull may wait (``runtime.ps_timeout_s``).
        max_payload: frame payload cap in bytes (what workers accept; the server itself
            accepts no frame over its largest shard).
        snapshot_dir: where shards write their snapshots ("" = snapshots refused).
        encrypt: encrypt every frame (``runtime.encrypt``).
        topk_ratio: the share of values a top-k compressed push holds (``runtime.topk_ratio``).
        attempt_started: whether Spark really started the stage attempt a HELLO claims
            (None believes any newer attempt: for servers outside a Spark driver).
        max_sessions: worker connections at once (each holds a thread).
        torch_threads: torch's intra-op threads while the server runs (restored when the
            last server stops; 0 leaves them). Shards already run in parallel, one thread
            each, and an idle OpenMP pool spins: on a driver that shares its host with
            executors (local mode) that spinning took a third of the cores the workers
            compute on (``parameter_server.ps_torch_threads``).
        shared_memory_bytes: the most shared memory the areas of workers on the driver's
            host may take (0: none, every payload crosses the sockets).
        factor_layouts: each store's layout, to take pushes of sufficient factors
            (``runtime.sufficient_factors``; None: the server takes none).
        attempt_lock: the lock a new stage attempt begins under (a full-batch coordinator's:
            it publishes every shard's next point under it; None: the server's own).
        known: the executors' addresses (places are reserved for them; None: none known).
        task_started: independent tasks (``ps_barrier = false``): whether Spark runs task
            ``task_id`` for partition ``partition``, ``(partition, task_id) -> bool`` (None
            believes any newer task).
    """

    def __init__(
        self,
        stores: Sequence[ShardStore],
        host: str,
        secret: bytes,
        timeout_s: float,
        max_payload: int,
        snapshot_dir: str = "",
        *,
        encrypt: bool = False,
        attempt_started: Callable[[int], bool] | None = None,
        max_sessions: int = 256,
        topk_ratio: float = 0.01,
        torch_threads: int = 1,
        shared_memory_bytes: int = 0,
        factor_layouts: Sequence[FactorLayout] | None = None,
        attempt_lock: threading.Lock | None = None,
        known: Container[str] | None = None,
        task_started: Callable[[int, int], bool] | None = None,
    ) -> None:
        self.stores = list(stores)
        self._threads = _torch_threads.hold(torch_threads)
        self._attempts = StageAttempts(self.stores, snapshot_dir, attempt_started, attempt_lock, task_started)
        self.secret = secret
        self.timeout_s = timeout_s
        self.max_payload = max_payload
        codecs = {c.code: c for c in push_codecs(topk_ratio)}
        largest = max((s.numel for s in self.stores), default=0)
        counts = max((layout.max_extra_bytes() for layout in factor_layouts or ()), default=0)
        frame_cap = max(4 * largest + counts, *(c.nbytes(largest) for c in codecs.values()), MAX_ERROR_BYTES)
        self.encrypt = encrypt
        self.areas: ServerAreas | None = None  # made once the port is bound (a failed bind leaks nothing)
        self._listener = ConnectionListener(
            host,
            PS_WIRE,
            secret,
            self._serve,
            "sparkdl-ps",
            log,
            encrypt=encrypt,
            max_sessions=max_sessions,
            known=known,
        )
        self.host, self.port = self._listener.host, self._listener.port
        self.public_key = self._listener.public_key  # the endpoints' server_key
        self.areas = _shared_areas(self.stores, codecs.values(), shared_memory_bytes)
        self._requests = RequestHandler(
            self.stores,
            self.areas,
            codecs,
            timeout_s,
            PARK_MAX_VALUES,
            self._attempts,
            self._listener.refusals,
            factor_layouts,
        )
        self._parked = self._requests.parked
        self._sessions = Sessions(self._requests, self._attempts, self.areas, self._listener, frame_cap)

    @property
    def refusals(self) -> dict[str, int]:
        """Refused connections and frames by reason (HELLOs, bad frames, pushes)."""
        return dict(self._listener.refusals.counts)

    @property
    def rejected_pushes(self) -> int:
        """Pushes and stage attempts rejected (:attr:`rejected` holds the latest reasons)."""
        return self._requests.rejected_pushes

    @property
    def rejected(self) -> collections.deque[str]:
        """The latest reasons a push or stage attempt was rejected (at most 100)."""
        return self._requests.rejected

    @property
    def nonfinite_pushes(self) -> int:
        """Pushes rejected for NaN or infinite values."""
        return self._requests.nonfinite_pushes

    def current_task(self, partition: int) -> int:
        """Independent tasks: the Spark task id whose pushes ``partition``'s are (-1: none yet)."""
        return self._attempts.current_task(partition)

    def task_not_running(self, partition: int, task: int) -> None:
        """Independent tasks: Spark no longer runs ``task`` of ``partition`` (the driver's
        watch read its status store), though its connection may look open (a host cut off,
        until TCP keepalive ends it): under ssp it holds nobody back until it pushes again."""
        self._attempts.end_task(partition, task)

    def task_silence(self) -> dict[int, float]:
        """Independent tasks: seconds since each partition with an open connection was last
        heard from (the driver's stall watch); empty for barrier workers."""
        return self._attempts.silence() if self._attempts.independent else {}

    def task_ledger(self) -> dict[str, object]:
        """Independent tasks: per partition, the rows whose pushes were applied and the
        monotonic times of its latest pushes; the takeovers of retried task attempts."""
        store = self.stores[0]
        return {
            "rows_applied": list(store.rows_applied),
            "push_times": [list(times) for times in store.push_times],
            "takeovers": list(self._attempts.takeovers),
        }

    def endpoint(self, shard_params: tuple[tuple[int, ...], ...]) -> PsEndpoint:
        return PsEndpoint(
            self.host,
            self.port,
            self.secret,
            self.public_key,
            shard_params,
            self.timeout_s,
            self.max_payload,
            self.encrypt,
            self.areas.info if self.areas is not None else None,
            tuple(store.numel for store in self.stores),
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Wake waiting pulls, close the port and every connection; join all threads (bounded)."""
        for shard, store in enumerate(self.stores):
            store.close()
            self._parked.answer(shard)  # the parked pulls are told, as waiting ones are
        # the waiting pulls woke with their error: let them send it before the sockets close
        self._sessions.wait_answered(min(timeout, _ANSWER_DRAIN_S))
        self._listener.stop(timeout)
        self._requests.stop_lines.flush()
        if self.areas is not None:
            self.areas.close()
        if self._threads:
            self._threads = False
            _torch_threads.release()

    def _serve(self, hello: Frame, channel: PsChannel, peer: tuple[str, int]) -> None:
        self._sessions.serve(hello, channel, peer)


class _ThreadsHold:
    """torch's intra-op thread count while servers run: set by the first, restored by the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._previous = 0

    def hold(self, threads: int) -> bool:
        if threads <= 0:
            return False
        with self._lock:
            if self._holders == 0:
                self._previous = torch.get_num_threads()
                torch.set_num_threads(threads)
            self._holders += 1
        return True

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                torch.set_num_threads(self._previous)


_torch_threads = _ThreadsHold()


@contextlib.contextmanager
def server_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads as a running server holds them (``threads``; 0: as they are),
    for work on the driver that should see what the server's threads see."""
    held = _torch_threads.hold(threads)
    try:
        yield
    finally:
        if held:
            _torch_threads.release()


def _shared_areas(stores: Sequence[ShardStore], codecs: Iterable[Codec], budget: int) -> ServerAreas | None:
    """Shared memory for the connections of workers on the driver's host: an area per
    connection (each worker holds one per shard; twice that while a failed stage attempt's
    connections close), as many as ``budget`` bytes hold; None when none fits or the
    memory cannot be made (the workers then use their sockets)."""
    largest = max((s.numel for s in stores), default=0)
    if budget <= 0 or largest == 0 or not shared_memory_supported():
        return None
    push_bytes = max(4 * largest, *(c.nbytes(largest) for c in codecs))
    one_area = slot_bytes(push_bytes, 4 * largest)
    wanted = 2 * max(s.num_workers for s in stores) * len(stores)
    slots = min(wanted, budget // one_area)
    if slots == 0:
        log.info(
            "parameter server: no shared memory: one area (%d bytes) is over ps_shared_memory_mb", one_area
        )
        return None
    try:
        return ServerAreas(slots, push_bytes, 4 * largest)
    except OSError as exc:
        log.warning("parameter server: no shared memory for workers on the driver's host: %s", exc)
        return None
