"""The parameter server's socket side: one listening socket on the driver, a thread per
worker connection, shards served in parallel (each shard has its own lock).

Every connection must open with an authenticated HELLO (the listener's handshake,
:mod:`sparkdl.wire.listener`); it binds the connection to one rank and one stage attempt,
and a frame claiming another closes it. A frame that fails authentication, is
truncated, or announces more than the largest shard closes that connection (logged
with the peer's address, rate-limited); the other workers are not affected. A request
that fails is answered with an ERROR frame whose code names the error
(:class:`sparkdl.services.ps.protocol.ErrorCode`); a rejected push (stale attempt, duplicate
clock, wrong size or dtype, a NaN or infinite value) is counted and logged.

Stage attempts. A HELLO from a newer stage attempt restarts the clocks, so it is only
believed when ``attempt_started`` confirms Spark started that attempt (the driver asks
Spark's status store: :func:`sparkdl.spark.attempts.attempt_gate`); a worker holding
the secret cannot lock the running attempt out by claiming a newer one.

Snapshots. With a checkpoint directory, rank 0 asks every shard for a SNAPSHOT
right before it writes the worker checkpoint of global step ``s``; each shard
writes ``ps-shard-NNN-<s>.pt`` there (atomically, newest two kept). A stage attempt
whose HELLO says it resumes from step ``s`` first returns every shard to its
snapshot of ``s``: the state that checkpoint was taken with.

Shared memory. Workers on the driver's own host may ask, in their HELLO, for an area of
the server's shared memory (:mod:`sparkdl.comm.ps_areas`); their PUSH and WEIGHTS payloads
then go through it, and only the authenticated headers cross the socket.

Parked pulls. A pull through shared memory that must wait for other workers' pushes is
not waited for on its connection's thread: it is parked, and the push that makes it
answerable writes the weights into that worker's area and sends the answer (a header).
Its thread sleeps on the socket until the worker's next request, or answers the pull
with a timeout at its deadline; it is not woken in between (:data:`PARK_MAX_VALUES`).
"""

from __future__ import annotations

import collections
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sparkdl.comm.compression.codecs import Codec, push_codecs
from sparkdl.comm.ps_areas import ServerAreas, shared_memory_supported, slot_bytes
from sparkdl.comm.ps_endpoint import PsEndpoint
from sparkdl.config import PsMode
from sparkdl.errors import (
    CheckpointError,
    ConnectionClosed,
    ParameterServerError,
    ProtocolError,
    PushRejected,
)
from sparkdl.services.ps.protocol import (
    BF16,
    FLOAT32,
    MAX_ERROR_BYTES,
    PS_WIRE,
    Frame,
    Kind,
    PsChannel,
    error_frame,
)
from sparkdl.services.ps.store import ShardStore
from sparkdl.storage.checkpoint_store import CheckpointStore
from sparkdl.wire.framing import ReusedBuffer
from sparkdl.wire.listener import ConnectionListener, one_line

log = logging.getLogger(__name__)

#: A pull through shared memory that must wait is parked when its shard holds at most this
#: many values: the push that completes its clock answers it, and its connection's thread is
#: not woken (on the strategies benchmark's 85k-value shard that saved a wake-up, a
#: condition wait and the threads' turns at the GIL, per worker and step: 0.54 to 0.73 of
#: all-reduce's samples/s). The thread that answers copies every waiting worker's weights,
#: one after the other (85k values: 10 us a copy); at this size a copy costs about what it
#: saves, and for a larger shard each connection's thread copies its own, in parallel.
PARK_MAX_VALUES = 1 << 18


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
    ) -> None:
        self.stores = list(stores)
        self._threads = _torch_threads.hold(torch_threads)
        self._snapshots = [
            CheckpointStore(snapshot_dir, name=f"ps-shard-{i:03d}") if snapshot_dir else None
            for i in range(len(self.stores))
        ]
        self._attempt: int | None = None  # the stage attempt the stores serve now
        self._pushers = 0  # ... and how many push to them (0: every worker)
        self._attempt_lock = threading.Lock()
        self.secret = secret
        self.timeout_s = timeout_s
        self.max_payload = max_payload
        self._codecs = {c.code: c for c in push_codecs(topk_ratio)}
        largest = max((s.numel for s in self.stores), default=0)
        self._frame_cap = max(
            4 * largest, *(c.nbytes(largest) for c in self._codecs.values()), MAX_ERROR_BYTES
        )
        self._attempt_started = attempt_started
        self.encrypt = encrypt
        self.rejected: collections.deque[str] = collections.deque(maxlen=100)  # the latest reasons
        self.rejected_pushes = 0
        self.nonfinite_pushes = 0
        self.areas: ServerAreas | None = None  # made once the port is bound (a failed bind leaks nothing)
        self._parked = [_Parked() for _ in self.stores]
        self._listener = ConnectionListener(
            host, PS_WIRE, secret, self._serve, "sparkdl-ps", log, encrypt=encrypt, max_sessions=max_sessions
        )
        self.host, self.port = self._listener.host, self._listener.port
        self.areas = _shared_areas(self.stores, self._codecs.values(), shared_memory_bytes)

    @property
    def refusals(self) -> dict[str, int]:
        """Refused connections and frames by reason (HELLOs, bad frames, pushes)."""
        return dict(self._listener.refusals.counts)

    def endpoint(self, shard_params: tuple[tuple[int, ...], ...]) -> PsEndpoint:
        return PsEndpoint(
            self.host,
            self.port,
            self.secret,
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
            self._answer_parked(shard)  # the parked pulls are told, as waiting ones are
        self._listener.stop(timeout)
        if self.areas is not None:
            self.areas.close()
        if self._threads:
            self._threads = False
            _torch_threads.release()

    def _serve(self, hello: Frame, channel: PsChannel, peer: tuple[str, int]) -> None:
        warm = _WarmBuffers()  # this connection's pushes and pulled weights, reused
        try:
            try:
                self._begin_attempt(hello.attempt, hello.clock, hello.rows)
            except (PushRejected, CheckpointError) as exc:
                channel.send(error_frame(exc))
                self._reject(peer, str(exc))
                return
            if hello.area and self.areas is not None:
                warm.area = self.areas.acquire()
            channel.send(Frame(Kind.ACK, area=0 if warm.area is None else warm.area + 1))
            while not self._listener.stopping:
                self._await_answer(channel, warm)
                frame = self._next_frame(channel, hello, warm)
                self._check_answered(warm)
                replies: list[Frame] = []
                if frame.kind is Kind.PUSH:
                    ack = self._handle(frame, warm)  # only a pull is ever parked
                    assert ack is not None
                    replies.append(ack)
                    # the PULL that push_pull sent right behind its PUSH: both answers leave in
                    # one sendmsg, so the worker wakes once (only behind an ACK: a WEIGHTS
                    # answer's memory would be the next one's)
                    if replies[0].kind is not Kind.ACK or not channel.pending():
                        channel.send_many(replies)
                        continue
                    frame = self._next_frame(channel, hello, warm)
                reply = self._handle(frame, warm, (channel, replies))
                if reply is not None:  # None: parked, answered with ``replies`` ahead of it
                    channel.send_many([*replies, reply])
        except ProtocolError as exc:
            if not self._listener.stopping and not isinstance(exc, ConnectionClosed):
                self._listener.refusals.add("frame refused", peer, str(exc))
        except OSError:
            pass  # the worker went away, or stop() closed the socket
        finally:
            if warm.waiting is not None:
                self._withdraw(warm)
            if warm.area is not None and self.areas is not None:
                self.areas.release(warm.area)

    def _begin_attempt(self, attempt: int, start_clock: int, pushers: int = 0) -> None:
        """The first connection of a new stage attempt restarts the clocks (and restores
        the snapshot of ``start_clock`` when the workers resumed from a checkpoint); every
        connection of an attempt must agree on its pushers (0: every worker pushes)."""
        with self._attempt_lock:
            if self._attempt is not None and attempt <= self._attempt:
                if attempt < self._attempt:
                    raise PushRejected(f"stage attempt {attempt} is older than the current {self._attempt}")
                if pushers != self._pushers:
                    raise PushRejected(
                        f"a HELLO of stage attempt {attempt} says {pushers} pushers, its first said "
                        f"{self._pushers} (0 = every worker): the workers disagree about runtime.hierarchy"
                    )
                return
            if self._attempt_started is not None and not self._attempt_started(attempt):
                raise PushRejected(
                    f"a HELLO claims stage attempt {attempt} (running: {self._attempt}), but Spark "
                    "runs no such attempt of the training stage"
                )
            states = [
                self._load_snapshot(i, start_clock) if start_clock else None for i in range(len(self.stores))
            ]
            for store, state in zip(self.stores, states, strict=True):
                store.begin_attempt(attempt, start_clock, state, pushers)
            self._attempt = attempt
            self._pushers = pushers
            if start_clock:
                log.info(
                    "parameter server resumed at step %d, versions %s",
                    start_clock,
                    [s.version for s in self.stores],
                )

    def _load_snapshot(self, shard: int, step: int) -> dict:
        snapshots = self._snapshots[shard]
        if snapshots is None or step not in snapshots.steps():
            where = snapshots.directory if snapshots else "(no checkpoint_dir given to the server)"
            raise CheckpointError(
                f"the workers resume from step {step}, but shard {shard} has no snapshot of it in "
                f"{where}; the checkpoint directory is incomplete: start afresh with a new checkpoint_dir"
            )
        return snapshots.load(step)

    def _save_snapshot(self, shard: int, step: int) -> int:
        snapshots = self._snapshots[shard]
        if snapshots is None:
            raise CheckpointError("snapshot requested but the parameter server has no checkpoint_dir")
        state = self.stores[shard].snapshot()
        snapshots.save(step, {"format": 1, **state})
        return int(state["version"])

    def _next_frame(self, channel: PsChannel, hello: Frame, warm: _WarmBuffers) -> Frame:
        """The connection's next request, which must be of the rank and attempt of its HELLO."""
        frame = channel.recv(self._frame_cap, into=warm.push_payload)
        if (frame.rank, frame.attempt) != (hello.rank, hello.attempt):
            raise ProtocolError(
                f"a frame of rank {frame.rank} attempt {frame.attempt} on the connection of "
                f"rank {hello.rank} attempt {hello.attempt}"
            )
        return frame

    def _handle(self, frame: Frame, warm: _WarmBuffers, park: _Park | None = None) -> Frame | None:
        """The answer to one request: its result, or an ERROR frame with the error's code;
        None when a pull was parked (``park``: its channel, and the answers that go ahead of it)."""
        if not 0 <= frame.shard < len(self.stores):
            raise ProtocolError(f"shard {frame.shard} does not exist (the server has {len(self.stores)})")
        try:
            reply = self._answer(frame, warm, park)
        except (ParameterServerError, CheckpointError) as exc:
            if isinstance(exc, PushRejected):
                self._reject(("rank", frame.rank), str(exc))
            reply = error_frame(exc, frame.shard)
        return reply

    def _answer(self, frame: Frame, warm: _WarmBuffers, park: _Park | None = None) -> Frame | None:
        store = self.stores[frame.shard]
        if frame.area and (warm.area is None or frame.area != warm.area + 1):
            raise ProtocolError(
                f"a {frame.kind.name} frame names shared area {frame.area - 1}, the connection holds "
                f"{'none' if warm.area is None else warm.area}"
            )
        if frame.kind is Kind.PUSH:
            grad = self._gradient(frame, store.numel, warm.area if frame.area else None)
            if not _all_finite(grad):
                self.nonfinite_pushes += 1
                raise PushRejected(
                    f"push to shard {frame.shard} at clock {frame.clock} holds NaN or infinite values; "
                    "it was not applied (the worker's own NaN guard should have skipped that step)"
                )
            staleness = store.push(frame.rank, frame.attempt, frame.clock, frame.rows, grad)
            self._answer_parked(frame.shard)
            return Frame(Kind.ACK, shard=frame.shard, staleness=staleness)
        if frame.kind is Kind.PULL:
            if frame.dtype not in (FLOAT32, BF16):
                raise ProtocolError(
                    f"pull of shard {frame.shard} in encoding {frame.dtype}: fp32 or bf16 only"
                )
            if park is None or not frame.area or store.mode is PsMode.ASYNC or store.numel > PARK_MAX_VALUES:
                return self._weights(frame, warm, wait=True)
            parked = self._parked[frame.shard]
            with parked.lock:
                reply = self._weights(frame, warm, wait=False)
                if reply is None:
                    warm.waiting = _Waiting(frame, warm, *park, time.monotonic() + self.timeout_s)
                    parked.waiting.append(warm.waiting)
                return reply
        if frame.kind is Kind.ABORT:
            reason = one_line(bytes(frame.payload).decode(errors="replace"), MAX_ERROR_BYTES)
            log.warning("parameter server: rank %d stopped: %s", frame.rank, reason)
            for shard, each in enumerate(self.stores):
                each.abort(f"rank {frame.rank} stopped: {reason}")
                self._answer_parked(shard)
            return Frame(Kind.ACK, shard=frame.shard)
        if frame.kind is Kind.SNAPSHOT:
            version = self._save_snapshot(frame.shard, frame.clock)
            return Frame(Kind.ACK, shard=frame.shard, version=version)
        raise ProtocolError(f"unexpected {frame.kind.name} frame from a worker")

    def _weights(self, pull: Frame, warm: _WarmBuffers, wait: bool) -> Frame | None:
        """The WEIGHTS answer to ``pull`` (in the connection's area when it names it, in the
        encoding it asks for); None when it must wait and ``wait`` is False."""
        store = self.stores[pull.shard]
        area = None  # the worker's area, in the encoding it asked for
        if pull.area:
            assert self.areas is not None and warm.area is not None
            dtype = torch.float32 if pull.dtype == FLOAT32 else torch.bfloat16
            area = self.areas.weights_area(warm.area, store.numel, dtype)
        out = area if area is not None and pull.dtype == FLOAT32 else warm.weights(store.numel)
        if wait:
            version, weights = store.pull(pull.rank, pull.clock, self.timeout_s, out)
        else:
            pulled = store.try_pull(pull.rank, pull.clock, out)
            if pulled is None:
                return None
            version, weights = pulled
        ahead = store.ahead_of(pull.clock)  # backup workers: the clocks this worker may skip
        if area is not None:
            if pull.dtype == BF16:  # rounded into the area (float32 was pulled straight into it)
                area.copy_(weights)
            payload: memoryview | bytes = b""
            area_bytes = area.numel() * area.element_size()
        else:
            payload = weights.numpy().data if pull.dtype == FLOAT32 else warm.bf16(weights).numpy().data
            area_bytes = 0
        return Frame(
            Kind.WEIGHTS,
            shard=pull.shard,
            version=version,
            staleness=ahead,
            payload=payload,
            dtype=pull.dtype,
            area=pull.area,
            area_bytes=area_bytes,
        )

    def _answer_parked(self, shard: int) -> None:
        """Answer the parked pulls of ``shard`` that a push (or an abort) made answerable."""
        parked = self._parked[shard]
        with parked.lock:
            if not parked.waiting:  # after every push: usually none
                return
            for waiting in list(parked.waiting):
                reply = self._parked_reply(waiting)
                if reply is not None:
                    self._deliver(parked, waiting, reply)

    def _parked_reply(self, waiting: _Waiting) -> Frame | None:
        """A parked pull's answer now: its weights, or the ERROR of an aborted attempt or a
        stopping server; None while it must wait."""
        try:
            return self._weights(waiting.pull, waiting.warm, wait=False)
        except ParameterServerError as exc:
            return error_frame(exc, waiting.pull.shard)

    def _await_answer(self, channel: PsChannel, warm: _WarmBuffers) -> None:
        """While this connection's pull is parked: sleep until the worker's next frame, or
        answer the pull at its deadline (then read on): with the weights if the push that
        makes it answerable has not answered it yet, with a timeout otherwise."""
        waiting = warm.waiting
        if waiting is None:
            return
        while (remaining := waiting.deadline - time.monotonic()) > 0:
            if channel.pending(remaining):  # a poll waits 24 days at most: ask again after
                return
        parked = self._parked[waiting.pull.shard]
        with parked.lock:
            if warm.waiting is not waiting:  # answered meanwhile
                return
            reply = self._parked_reply(waiting)
            if reply is None:
                store = self.stores[waiting.pull.shard]
                error = store.pull_timeout(waiting.pull.rank, waiting.pull.clock, self.timeout_s)
                reply = error_frame(error, waiting.pull.shard)
            self._deliver(parked, waiting, reply)

    def _check_answered(self, warm: _WarmBuffers) -> None:
        """A worker sends its next request only once its parked pull was answered."""
        waiting = warm.waiting
        if waiting is not None:
            with self._parked[waiting.pull.shard].lock:
                if warm.waiting is not None:
                    raise ProtocolError(
                        f"rank {waiting.pull.rank} sent a request while its pull of clock "
                        f"{waiting.pull.clock} waited for its answer"
                    )

    def _deliver(self, parked: _Parked, waiting: _Waiting, reply: Frame) -> None:
        """Send a parked pull's answer, behind the answers that go ahead of it, under the
        shard's parked lock. The pull stays parked until the answer is sent: the
        connection's own thread, which reads the worker's next request meanwhile, waits
        for the lock before it answers (:meth:`_check_answered`), so one thread at a time
        sends on the channel. A worker that leaves its answers unread is cut off, never
        waited for."""
        try:
            waiting.channel.send_many([*waiting.before, reply], wait=False)
        except BlockingIOError as exc:  # its socket's buffer is full: it reads no answers
            self._listener.refusals.add("answer undeliverable", ("rank", waiting.pull.rank), str(exc))
            try:
                waiting.channel.sock.shutdown(socket.SHUT_RDWR)  # its thread then ends
            except OSError:
                pass
        except OSError:
            pass  # the worker went away: its thread finds the connection closed
        finally:
            parked.waiting.remove(waiting)
            waiting.warm.waiting = None

    def _withdraw(self, warm: _WarmBuffers) -> None:
        """The connection ends: its parked pull, if still unanswered, is dropped."""
        waiting = warm.waiting
        if waiting is not None:
            parked = self._parked[waiting.pull.shard]
            with parked.lock:
                if warm.waiting is waiting:
                    parked.waiting.remove(waiting)
                    warm.waiting = None

    def _gradient(self, frame: Frame, numel: int, area: int | None) -> torch.Tensor:
        """The float32 gradient a PUSH carries, plain or compressed (the frame's dtype), in
        the frame or in the connection's shared ``area``."""
        codec = self._codecs.get(frame.dtype)
        if codec is None and frame.dtype != FLOAT32:
            raise PushRejected(
                f"push to shard {frame.shard} in encoding {frame.dtype}, which this server does not know"
            )
        name, expected = ("float32", 4 * numel) if codec is None else (codec.name, codec.nbytes(numel))
        if area is not None and len(frame.payload):
            raise ProtocolError("a PUSH names its shared area and carries a payload as well")
        size = frame.area_bytes if area is not None else len(frame.payload)
        if size != expected:
            raise PushRejected(
                f"push of {size} bytes to shard {frame.shard}, which takes {expected} bytes "
                f"of {name} ({numel} values)"
            )
        if area is not None:
            assert self.areas is not None
            data = self.areas.push_area(area, expected)  # fits: the area takes the largest push
        else:
            data = torch.from_numpy(np.frombuffer(frame.payload, dtype=np.uint8))
        if codec is None:
            return data.view(torch.float32)
        try:
            return codec.decode(data, numel)
        except ValueError as exc:  # a malformed payload (a top-k index out of range)
            raise PushRejected(f"push to shard {frame.shard} in {codec.name} does not decode: {exc}") from exc

    def _reject(self, peer: tuple[str, int] | tuple[str, int | str], reason: str) -> None:
        self.rejected_pushes += 1
        self.rejected.append(reason)
        self._listener.refusals.add("request rejected", peer, reason)


_Park = tuple[PsChannel, list[Frame]]  # where a parked pull's answer goes, and what goes ahead of it


class _Parked:
    """The parked pulls of one shard. Its lock orders parking a pull, answering it, and the
    connection's next frame."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: list[_Waiting] = []


@dataclass
class _Waiting:
    """A parked pull: the request, its connection's buffers, channel and the answers that
    leave ahead of it (the ACK of the push before it), and when it times out."""

    pull: Frame
    warm: _WarmBuffers
    channel: PsChannel
    before: list[Frame]
    deadline: float


class _WarmBuffers:
    """One connection's reused memory (:class:`ReusedBuffer`): what a PUSH is read into (the
    store keeps no reference to it), and the weights a PULL sends (sent before the next
    frame is read); and its shared-memory area, when it has one."""

    def __init__(self) -> None:
        self.area: int | None = None  # the connection's shared-memory area, if it was granted one
        self.waiting: _Waiting | None = None  # the connection's parked pull (set and cleared under its lock)
        self._push = ReusedBuffer()
        self._weights = torch.empty(0)
        self._bf16 = torch.empty(0, dtype=torch.bfloat16)

    def push_payload(self, kind: int, fields: tuple[int, ...], length: int) -> memoryview | None:
        return self._push.view(length) if kind == Kind.PUSH else None

    def weights(self, numel: int) -> torch.Tensor:
        if self._weights.numel() < numel:
            self._weights = torch.empty(numel)
        return self._weights[:numel]

    def bf16(self, weights: torch.Tensor) -> torch.Tensor:
        """``weights`` rounded to bf16, as the 16-bit integers the wire carries (reused memory)."""
        if self._bf16.numel() < weights.numel():
            self._bf16 = torch.empty(weights.numel(), dtype=torch.bfloat16)
        half = self._bf16[: weights.numel()]
        half.copy_(weights)
        return half.view(torch.int16)


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


def _all_finite(values: torch.Tensor) -> bool:
    """Whether every value is finite: one float32 sum (NaN and infinities carry through it);
    only a sum that overflowed needs the element-wise look."""
    return math.isfinite(values.sum()) or bool(torch.isfinite(values).all())


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
