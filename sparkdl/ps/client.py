"""The worker's side of the parameter server: one connection per shard, used in parallel."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from sparkdl.compression.codecs import ErrorFeedback
from sparkdl.errors import ParameterServerError, ProtocolError
from sparkdl.net.framing import Placement, ReusedBuffer
from sparkdl.ps.endpoint import PsEndpoint
from sparkdl.ps.protocol import BF16, FLOAT32, Frame, Kind, PsChannel, client_hello, error_of

T = TypeVar("T")


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
        self.start_clock = start_clock
        self.pushers = pushers
        self.stats = ClientStats()
        self.ahead = 0
        shards = len(endpoint.shard_params)
        self._channels: list[PsChannel] = []
        try:
            for _ in range(shards):
                self._channels.append(self._connect())
        except BaseException:  # a refused or failed connection: close the ones already open
            for channel in self._channels:
                channel.sock.close()
            raise
        self._shards = shards
        self._weights = [ReusedBuffer() for _ in range(shards)]  # each shard's pulled weights land here
        self._widened = [torch.empty(0) for _ in range(shards)]  # bf16 pulls: their float32 values
        self._pool = ThreadPoolExecutor(max_workers=shards, thread_name_prefix="sparkdl-ps-client")

    def _connect(self) -> PsChannel:
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
            )
            self._expect(channel, Kind.ACK)
        except BaseException:
            sock.close()
            raise
        return channel

    def push(self, clock: int, rows: int, grads: list[torch.Tensor]) -> None:
        """Send each shard's rows-weighted gradient sum (flat float32 tensors) in parallel."""
        for result in self._each_shard(self._push_one, [(clock, rows, grad) for grad in grads]):
            self._count_push(*result)
        self.stats.pushes += 1

    def push_pull(
        self, clock: int, rows: int, grads: list[torch.Tensor], pull_clock: int
    ) -> list[tuple[int, torch.Tensor]]:
        """:meth:`push` then :meth:`pull` of ``pull_clock``, each shard's PULL sent right behind
        its PUSH (no wait for the ACK in between: one round trip per shard instead of two)."""
        started = time.perf_counter()
        shards = self._each_shard(self._push_pull_one, [(clock, rows, grad, pull_clock) for grad in grads])
        results, aheads = [], []
        for (sent, staleness), (pull_sent, received, version, weights, ahead) in shards:
            self._count_push(sent + pull_sent, staleness)
            self.stats.bytes_received += received
            results.append((version, weights))
            aheads.append(ahead)
        self.ahead = min(aheads, default=0)
        self.stats.wait_s += time.perf_counter() - started
        self.stats.pushes += 1
        self.stats.pulls += 1
        return results

    def _count_push(self, sent: int, staleness: int) -> None:
        self.stats.bytes_sent += sent
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

    def _push_frame(self, shard: int, clock: int, rows: int, grad: torch.Tensor) -> Frame:
        if self.feedback is None:
            return Frame(
                Kind.PUSH, shard, self.rank, self.attempt, clock, rows, grad.contiguous().numpy().data
            )
        payload = self.feedback.encode(shard, grad).numpy().data  # one stream per shard and thread
        return Frame(
            Kind.PUSH, shard, self.rank, self.attempt, clock, rows, payload, self.feedback.codec.code
        )

    def _push_one(self, shard: int, clock: int, rows: int, grad: torch.Tensor) -> tuple[int, int]:
        """Runs on a pool thread: returns (bytes sent, staleness the server measured)."""
        channel = self._channels[shard]
        sent = channel.send(self._push_frame(shard, clock, rows, grad))
        return sent, self._expect(channel, Kind.ACK).staleness

    def _push_pull_one(
        self, shard: int, clock: int, rows: int, grad: torch.Tensor, pull_clock: int
    ) -> tuple[tuple[int, int], tuple[int, int, int, torch.Tensor, int]]:
        """Runs on a pool thread: both requests go out before either answer is read (the
        server answers a connection's requests in order; an ERROR for the push raises here)."""
        channel = self._channels[shard]
        sent = channel.send(self._push_frame(shard, clock, rows, grad))
        pull_sent = channel.send(self._pull_frame(shard, pull_clock))
        staleness = self._expect(channel, Kind.ACK).staleness
        return (sent, staleness), self._read_weights(shard, pull_sent)

    def _pull_one(self, shard: int, clock: int) -> tuple[int, int, int, torch.Tensor, int]:
        """Runs on a pool thread: (bytes sent, bytes received, version, weights, clocks ahead)."""
        channel = self._channels[shard]
        sent = channel.send(self._pull_frame(shard, clock))
        return self._read_weights(shard, sent)

    def _pull_frame(self, shard: int, clock: int) -> Frame:
        return Frame(Kind.PULL, shard, self.rank, self.attempt, clock, dtype=self._pull_dtype)

    def _read_weights(self, shard: int, sent: int) -> tuple[int, int, int, torch.Tensor, int]:
        """The shard's WEIGHTS, read into its reused buffer (valid until its next pull)."""
        buffer = self._weights[shard]
        into: Placement = lambda kind, _, n: buffer.view(n) if kind == Kind.WEIGHTS else None  # noqa: E731
        reply = self._expect(self._channels[shard], Kind.WEIGHTS, into)
        if reply.dtype != self._pull_dtype:
            raise ParameterServerError(
                f"rank {self.rank}: asked for shard {shard}'s weights in encoding {self._pull_dtype}, "
                f"the server sent {reply.dtype}; the driver and the executors run different sparkdl versions"
            )
        if reply.dtype == FLOAT32:
            weights = torch.from_numpy(np.frombuffer(reply.payload, dtype=np.float32))
        else:  # bf16: widened into this shard's reused float32 buffer
            half = torch.from_numpy(np.frombuffer(reply.payload, dtype=np.int16)).view(torch.bfloat16)
            if self._widened[shard].numel() != half.numel():
                self._widened[shard] = torch.empty(half.numel())
            weights = self._widened[shard].copy_(half)
        return sent, len(reply.payload), reply.version, weights, reply.staleness

    def _expect(self, channel: PsChannel, kind: Kind, into: Placement | None = None) -> Frame:
        """The server's answer of ``kind``; an ERROR frame raises the class its code names."""
        try:
            frame = channel.recv(self.endpoint.max_payload, into)
        except (ProtocolError, OSError) as exc:
            raise ParameterServerError(
                f"rank {self.rank}: parameter server connection failed: {exc}"
            ) from exc
        if frame.kind is Kind.ERROR:
            raise error_of(frame, self.rank)
        if frame.kind is not kind:
            raise ParameterServerError(
                f"rank {self.rank}: expected {kind.name} from the server, got {frame.kind.name}"
            )
        return frame

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for channel in self._channels:
            channel.sock.close()
