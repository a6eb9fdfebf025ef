"""The worker's side of the parameter server: one connection per shard, used in parallel.

A worker on the driver's host maps the server's shared memory (:mod:`sparkdl.comm.ps_areas`) and
asks for an area on each connection: its pushes and pulled weights then go through it, and
only the frames' authenticated headers through the socket.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from sparkdl.comm.compression.codecs import ErrorFeedback
from sparkdl.comm.ps_areas import WorkerAreas, attach
from sparkdl.comm.ps_endpoint import PsEndpoint
from sparkdl.errors import ParameterServerError, ProtocolError, ServerBusy
from sparkdl.services.ps.factored import EncodedPush
from sparkdl.services.ps.protocol import BF16, FLOAT32, Frame, Kind, PsChannel, client_hello, error_of
from sparkdl.wire.framing import PayloadPlacement, ReusedBuffer
from sparkdl.wire.handshake import with_retries

T = TypeVar("T")


#: One shard's push: its flat float32 gradient, or a payload already encoded (sufficient factors).
Gradient = torch.Tensor | EncodedPush


class RunFinished(Exception):
    """A pull was answered that the full-batch run ended: the driver's coordinator stopped."""


@dataclass
class ClientStats:
    pushes: int = 0
    pulls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_s: float = 0.0
    staleness_sum: int = 0  # running figures: one entry per push would grow all epoch
    staleness_max: int = 0
    late_pushes: int = 0  # shard pushes the server called late (sync with backups: dropped)
    shared_sent: int = 0  # of bytes_sent, what went through shared memory (never a network)


class PsClient:
    """Pushes gradient shards and pulls weight shards for one worker.

    Args:
        endpoint: the server's address, secret and shard layout.
        rank: this worker's rank.
        attempt: the stage attempt number (a retry must not mix with the old attempt).
        start_clock: the first clock of this attempt (the global step the workers
            resumed from; 0 when they start afresh).
        feedback: compress pushes with this codec and error feedback (None: float32).
        pushers: the attempt pushes through that many pushers, ``rank`` being this one's
            number among them (a hierarchy's hosts); 0: every worker pushes.
        bf16_pulls: ask for the weights in bf16 (half the bytes; the pulled float32 weights
            are then the server's rounded to bf16).
    """

    def __init__(
        self,
        endpoint: PsEndpoint,
        rank: int,
        attempt: int,
        start_clock: int = 0,
        feedback: ErrorFeedback | None = None,
        pushers: int = 0,
        bf16_pulls: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self._pull_dtype = BF16 if bf16_pulls else FLOAT32
        self.feedback = feedback
        self.rank = rank
        self.attempt = attempt
        #: independent tasks: rows of steps dropped (non-finite) since the last push, which the
        #: next push tells the server (its partition's rows covered count them; none trained)
        self.rows_dropped = 0
        self.start_clock = start_clock
        self.pushers = pushers
        self.stats = ClientStats()
        self.ahead = 0
        self.rows_done: int | None = None  # independent tasks: the partition's rows the server applied
        shards = len(endpoint.shard_params)
        self._memory: WorkerAreas | None = attach(endpoint.areas) if endpoint.shard_sizes else None
        self._channels: list[PsChannel] = []
        self._areas: list[int | None] = []  # each connection's shared area, if the server granted one
        try:
            for _ in range(shards):
                channel, area = self._connect()
                self._channels.append(channel)
                self._areas.append(area)
        except BaseException:  # a refused or failed connection: close the ones already open
            for channel in self._channels:
                channel.sock.close()
            if self._memory is not None:
                self._memory.close()
            raise
        self._shards = shards
        self._weights = [ReusedBuffer() for _ in range(shards)]  # each shard's pulled weights land here
        self._widened = [torch.empty(0) for _ in range(shards)]  # bf16 pulls: their float32 values
        self._pool = ThreadPoolExecutor(max_workers=shards, thread_name_prefix="sparkdl-ps-client")

    @property
    def shared_areas(self) -> int:
        """How many of this worker's connections send their payloads through shared memory."""
        return sum(area is not None for area in self._areas)

    def _connect(self) -> tuple[PsChannel, int | None]:
        """A connection that said HELLO, and the shared area the server granted it (or None);
        a handshake the server closed before answering (a flood at its port) is tried again."""
        try:
            return with_retries(self._open, f"rank {self.rank}: parameter server")
        except (ServerBusy, OSError) as exc:
            raise ParameterServerError(
                f"rank {self.rank}: the parameter server at {self.endpoint.host}:{self.endpoint.port} "
                f"turned every handshake away ({exc}): its pending handshakes stayed full, something "
                "floods the driver's ports"
            ) from exc

    def _open(self) -> tuple[PsChannel, int | None]:
        try:
            sock = socket.create_connection((self.endpoint.host, self.endpoint.port), timeout=30)
        except OSError as exc:
            raise ParameterServerError(
                f"rank {self.rank}: cannot reach the parameter server at "
                f"{self.endpoint.host}:{self.endpoint.port} ({exc}); executors must reach the driver "
                "on spark.driver.host"
            ) from exc
        sock.settimeout(self.endpoint.timeout_s + 30)  # the server answers a stuck pull itself
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            channel = client_hello(
                sock,
                self.endpoint.secret,
                self.rank,
                self.attempt,
                self.start_clock,
                self.endpoint.encrypt,
                self.pushers,
                want_area=self._memory is not None,
                server_key=self.endpoint.server_key,
            )
            ack = self._expect(channel, Kind.ACK, handshake=True)
            granted = ack.area
            # an independent task: its partition's rows already in the weights (the same on
            # every shard's ACK but for a push landing between two HELLOs: the least counts)
            self.rows_done = ack.rows if self.rows_done is None else min(self.rows_done, ack.rows)
        except BaseException:
            sock.close()
            raise
        return channel, granted - 1 if granted and self._memory is not None else None

    def push(self, clock: int, rows: int, grads: Sequence[Gradient], loss_sum: float = 0.0) -> None:
        """Send each shard's rows-weighted gradient sum (flat float32 tensors) in parallel;
        ``loss_sum``: a full-batch pass's summed loss, which every shard's PUSH carries."""
        for result in self._each_shard(self._push_one, [(clock, rows, grad, loss_sum) for grad in grads]):
            self._count_push(*result)  # (bytes, of them through shared memory, staleness)
        self.stats.pushes += 1
        self.rows_dropped = 0

    def push_pull(
        self, clock: int, rows: int, grads: Sequence[Gradient], pull_clock: int
    ) -> list[tuple[int, torch.Tensor]]:
        """:meth:`push` then :meth:`pull` of ``pull_clock``, each shard's PULL sent right behind
        its PUSH (no wait for the ACK in between: one round trip per shard instead of two)."""
        started = time.perf_counter()
        shards = self._each_shard(self._push_pull_one, [(clock, rows, grad, pull_clock) for grad in grads])
        results, aheads = [], []
        for (sent, shared, staleness), (_, received, version, weights, ahead) in shards:
            self._count_push(sent, shared, staleness)
            self.stats.bytes_received += received
            results.append((version, weights))
            aheads.append(ahead)
        self.ahead = min(aheads, default=0)
        self.stats.wait_s += time.perf_counter() - started
        self.stats.pushes += 1
        self.stats.pulls += 1
        self.rows_dropped = 0
        return results

    def _count_push(self, sent: int, shared: int, staleness: int) -> None:
        self.stats.bytes_sent += sent
        self.stats.shared_sent += shared
        self.stats.staleness_sum += staleness
        self.stats.staleness_max = max(self.stats.staleness_max, staleness)
        self.stats.late_pushes += staleness > 0

    def pull(self, clock: int) -> list[tuple[int, torch.Tensor]]:
        """(version, flat weights) of every shard for a worker about to compute ``clock``;
        :attr:`ahead` is then how many clocks past ``clock`` every shard already is. The
        weights are valid until the next pull (each shard's memory is reused)."""
        started = time.perf_counter()
        results = []
        aheads = []
        for sent, received, version, weights, ahead in self._each_shard(
            self._pull_one, [(clock,)] * self._shards
        ):
            self.stats.bytes_sent += sent
            self.stats.bytes_received += received
            results.append((version, weights))
            aheads.append(ahead)
        self.ahead = min(aheads, default=0)
        self.stats.wait_s += time.perf_counter() - started
        self.stats.pulls += 1
        return results

    def snapshot(self, step: int) -> list[int]:
        """Have every shard save itself as of global step ``step``; return their versions."""
        return list(self._each_shard(self._snapshot_one, [(step,)] * self._shards))

    def _each_shard(self, call: Callable[..., T], args: list[tuple]) -> Iterator[T]:
        """``call(shard, *args[shard])`` for every shard, in parallel on the pool; inline for
        a single shard (no thread hand-off). Results in shard order; the first error raises."""
        if len(args) == 1:
            yield call(0, *args[0])
            return
        futures = [self._pool.submit(call, shard, *each) for shard, each in enumerate(args)]
        for future in futures:
            yield future.result()

    def _snapshot_one(self, shard: int, step: int) -> int:
        channel = self._channels[shard]
        channel.send(Frame(Kind.SNAPSHOT, shard, self.rank, self.attempt, step))
        return self._expect(channel, Kind.ACK).version

    def abort(self, reason: str) -> None:
        """Tell the server this worker stops: every other worker's next pull or push fails."""
        channel = self._channels[0]
        channel.send(Frame(Kind.ABORT, 0, self.rank, self.attempt, payload=reason.encode()[:4000]))
        self._expect(channel, Kind.ACK)

    def _push_frame(
        self, shard: int, clock: int, rows: int, grad: Gradient, loss: float = 0.0
    ) -> tuple[Frame, int]:
        """The PUSH of ``grad`` (its payload in the frame or in the shard's shared area), and
        the payload bytes that went through shared memory. A push already encoded (sufficient
        factors) travels in the frame as it is."""
        if isinstance(grad, EncodedPush):
            payload = grad.data.numpy().data
            return Frame(Kind.PUSH, shard, self.rank, self.attempt, clock, rows, payload, grad.code), 0
        if self.feedback is None:
            dtype, data = FLOAT32, grad.contiguous().view(torch.uint8)
        else:  # one error-feedback stream per shard and thread
            dtype, data = self.feedback.codec.code, self.feedback.encode(shard, grad)
        area = self._areas[shard]
        if area is None:
            payload = data.numpy().data
            return Frame(Kind.PUSH, shard, self.rank, self.attempt, clock, rows, payload, dtype, loss=loss), 0
        assert self._memory is not None
        self._memory.push_area(area, data.numel()).copy_(data)
        frame = Frame(
            Kind.PUSH,
            shard,
            self.rank,
            self.attempt,
            clock,
            rows,
            b"",
            dtype,
            area=area + 1,
            area_bytes=data.numel(),
            loss=loss,
        )
        return frame, data.numel()

    def _send_push(
        self,
        shard: int,
        clock: int,
        rows: int,
        grad: Gradient,
        pull_clock: int | None = None,
        loss: float = 0.0,
    ) -> tuple[int, int]:
        """Send shard ``shard``'s PUSH, and the PULL of ``pull_clock`` behind it in the same
        ``sendmsg``; (bytes moved, the payload's wherever it went; of them, through shared memory)."""
        frame, shared = self._push_frame(shard, clock, rows, grad, loss)
        if self.rows_dropped:
            frame = frame._replace(staleness=self.rows_dropped)
        frames = (frame,) if pull_clock is None else (frame, self._pull_frame(shard, pull_clock))
        return self._channels[shard].send_many(frames) + shared, shared

    def _push_one(
        self, shard: int, clock: int, rows: int, grad: Gradient, loss: float = 0.0
    ) -> tuple[int, int, int]:
        """Runs on a pool thread: (bytes sent, of them through shared memory, staleness the
        server measured)."""
        sent, shared = self._send_push(shard, clock, rows, grad, loss=loss)
        return sent, shared, self._expect(self._channels[shard], Kind.ACK).staleness

    def _push_pull_one(
        self, shard: int, clock: int, rows: int, grad: Gradient, pull_clock: int
    ) -> tuple[tuple[int, int, int], tuple[int, int, int, torch.Tensor, int]]:
        """Runs on a pool thread: both requests go out before either answer is read (the
        server answers a connection's requests in order; an ERROR for the push raises here)."""
        sent, shared = self._send_push(shard, clock, rows, grad, pull_clock)
        staleness = self._expect(self._channels[shard], Kind.ACK).staleness
        return (sent, shared, staleness), self._read_weights(shard, 0)

    def _pull_one(self, shard: int, clock: int) -> tuple[int, int, int, torch.Tensor, int]:
        """Runs on a pool thread: (bytes sent, bytes received, version, weights, clocks ahead)."""
        channel = self._channels[shard]
        sent = channel.send(self._pull_frame(shard, clock))
        return self._read_weights(shard, sent)

    def _pull_frame(self, shard: int, clock: int) -> Frame:
        area = self._areas[shard]
        return Frame(
            Kind.PULL,
            shard,
            self.rank,
            self.attempt,
            clock,
            dtype=self._pull_dtype,
            area=0 if area is None else area + 1,
        )

    def _read_weights(self, shard: int, sent: int) -> tuple[int, int, int, torch.Tensor, int]:
        """The shard's WEIGHTS, read into its reused buffer (valid until its next pull)."""
        buffer = self._weights[shard]
        into: PayloadPlacement = lambda kind, _, n: buffer.view(n) if kind == Kind.WEIGHTS else None  # noqa: E731
        reply = self._expect(self._channels[shard], Kind.WEIGHTS, into)
        if reply.dtype != self._pull_dtype:
            raise ParameterServerError(
                f"rank {self.rank}: asked for shard {shard}'s weights in encoding {self._pull_dtype}, "
                f"the server sent {reply.dtype}; the driver and the executors run different sparkdl versions"
            )
        area = self._areas[shard]
        if reply.area != (0 if area is None else area + 1):
            raise ParameterServerError(
                f"rank {self.rank}: shard {shard}'s weights came "
                f"{f'in shared area {reply.area - 1}' if reply.area else 'in the frame'}, the connection "
                f"holds area {area}; the driver and the executors run different sparkdl versions"
            )
        if area is not None:  # the server wrote them into this connection's area
            assert self._memory is not None
            dtype = torch.float32 if reply.dtype == FLOAT32 else torch.bfloat16
            numel = self.endpoint.shard_sizes[shard]
            if reply.area_bytes != numel * dtype.itemsize:
                raise ParameterServerError(
                    f"rank {self.rank}: shard {shard}'s weights came as {reply.area_bytes} bytes in shared "
                    f"memory, {numel} {dtype} values were expected; the driver and the executors run "
                    "different sparkdl versions"
                )
            data = self._memory.weights_area(area, numel, dtype)
        else:
            wire = np.int16 if reply.dtype == BF16 else np.float32
            data = torch.from_numpy(np.frombuffer(reply.payload, dtype=wire))
        received = data.numel() * data.element_size()
        if reply.dtype == FLOAT32:
            weights = data
        else:  # bf16: widened into this shard's reused float32 buffer
            half = data.view(torch.bfloat16)
            if self._widened[shard].numel() != half.numel():
                self._widened[shard] = torch.empty(half.numel())
            weights = self._widened[shard].copy_(half)
        return sent, received, reply.version, weights, reply.staleness

    def _expect(
        self, channel: PsChannel, kind: Kind, into: PayloadPlacement | None = None, handshake: bool = False
    ) -> Frame:
        """The server's answer of ``kind``; an ERROR frame raises the class its code names.
        ``handshake``: the answer to a HELLO, whose closed connection is raised as it is (to
        be tried again)."""
        try:
            frame = channel.recv(self.endpoint.max_payload, into)
        except (ProtocolError, OSError) as exc:
            if handshake and isinstance(exc, ServerBusy | ConnectionResetError | BrokenPipeError):
                raise  # turned away: with_retries tries again

            raise ParameterServerError(
                f"rank {self.rank}: parameter server connection failed: {exc}"
            ) from exc
        if frame.kind is Kind.ERROR:
            raise error_of(frame, self.rank)
        if frame.kind is Kind.FINISHED and kind is Kind.WEIGHTS:
            raise RunFinished(f"rank {self.rank}: the full-batch run ended at version {frame.version}")
        if frame.kind is not kind:
            raise ParameterServerError(
                f"rank {self.rank}: expected {kind.name} from the server, got {frame.kind.name}"
            )
        return frame

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for channel in self._channels:
            channel.sock.close()
        if self._memory is not None:
            self._memory.close()
