"""The worker's side of the parameter server: one connection per shard, used in parallel."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from sparkdl.compression.codecs import ErrorFeedback
from sparkdl.errors import ParameterServerError, ProtocolError
from sparkdl.ps.endpoint import PsEndpoint
from sparkdl.ps.protocol import Frame, Kind, PsChannel, client_hello, error_of


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
    """

    def __init__(
        self,
        endpoint: PsEndpoint,
        rank: int,
        attempt: int,
        start_clock: int = 0,
        feedback: ErrorFeedback | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.feedback = feedback
        self.rank = rank
        self.attempt = attempt
        self.start_clock = start_clock
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
                sock, self.endpoint.secret, self.rank, self.attempt, self.start_clock, self.endpoint.encrypt
            )
            self._expect(channel, Kind.ACK)
        except BaseException:
            sock.close()
            raise
        return channel

    def push(self, clock: int, rows: int, grads: list[torch.Tensor]) -> None:
        """Send each shard's rows-weighted gradient sum (flat float32 tensors) in parallel."""
        futures = [
            self._pool.submit(self._push_one, shard, clock, rows, grad) for shard, grad in enumerate(grads)
        ]
        for future in futures:
            sent, staleness = future.result()
            self.stats.bytes_sent += sent
            self.stats.staleness_sum += staleness
            self.stats.staleness_max = max(self.stats.staleness_max, staleness)
            self.stats.late_pushes += staleness > 0
        self.stats.pushes += 1

    def pull(self, clock: int) -> list[tuple[int, torch.Tensor]]:
        """(version, flat weights) of every shard for a worker about to compute ``clock``;
        :attr:`ahead` is then how many clocks past ``clock`` every shard already is."""
        started = time.perf_counter()
        futures = [self._pool.submit(self._pull_one, shard, clock) for shard in range(len(self._channels))]
        results = []
        aheads = []
        for future in futures:
            sent, received, version, weights, ahead = future.result()
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
        futures = [self._pool.submit(self._snapshot_one, shard, step) for shard in range(len(self._channels))]
        return [future.result() for future in futures]

    def _snapshot_one(self, shard: int, step: int) -> int:
        channel = self._channels[shard]
        channel.send(Frame(Kind.SNAPSHOT, shard, self.rank, self.attempt, step))
        return self._expect(channel, Kind.ACK).version

    def abort(self, reason: str) -> None:
        """Tell the server this worker stops: every other worker's next pull or push fails."""
        channel = self._channels[0]
        channel.send(Frame(Kind.ABORT, 0, self.rank, self.attempt, payload=reason.encode()[:4000]))
        self._expect(channel, Kind.ACK)

    def _push_one(self, shard: int, clock: int, rows: int, grad: torch.Tensor) -> tuple[int, int]:
        """Runs on a pool thread: returns (bytes sent, staleness the server measured)."""
        channel = self._channels[shard]
        if self.feedback is None:
            frame = Frame(
                Kind.PUSH, shard, self.rank, self.attempt, clock, rows, grad.contiguous().numpy().data
            )
        else:  # one stream per shard, each on its own pool thread
            payload = self.feedback.encode(shard, grad).numpy().data
            frame = Frame(
                Kind.PUSH, shard, self.rank, self.attempt, clock, rows, payload, self.feedback.codec.code
            )
        sent = channel.send(frame)
        return sent, self._expect(channel, Kind.ACK).staleness

    def _pull_one(self, shard: int, clock: int) -> tuple[int, int, int, torch.Tensor, int]:
        """Runs on a pool thread: (bytes sent, bytes received, version, weights, clocks ahead)."""
        channel = self._channels[shard]
        sent = channel.send(Frame(Kind.PULL, shard, self.rank, self.attempt, clock))
        reply = self._expect(channel, Kind.WEIGHTS)
        weights = torch.from_numpy(np.frombuffer(reply.payload, dtype=np.float32))
        return sent, len(reply.payload), reply.version, weights, reply.staleness

    def _expect(self, channel: PsChannel, kind: Kind) -> Frame:
        """The server's answer of ``kind``; an ERROR frame raises the class its code names."""
        try:
            frame = channel.recv(self.endpoint.max_payload)
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
