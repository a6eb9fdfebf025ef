"""The worker's side of the parameter server: one connection per shard, used in parallel."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from sparkdl.errors import ParameterServerError, PeerStopped, PsTimeoutError, agreed
from sparkdl.ps.protocol import Channel, Frame, Kind, ProtocolError, client_hello
from sparkdl.ps.server import PsEndpoint


PsClientError = ParameterServerError  # the name older code and tests use


@dataclass
class ClientStats:
    pushes: int = 0
    pulls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_s: float = 0.0
    staleness_sum: int = 0  # running figures: one entry per push would grow all epoch
    staleness_max: int = 0


class PsClient:
    """Pushes gradient shards and pulls weight shards for one worker.

    Args:
        endpoint: the server's address, secret and shard layout.
        rank: this worker's rank.
        attempt: the stage attempt number (a retry must not mix with the old attempt).
        start_clock: the first clock of this attempt (the global step the workers
            resumed from; 0 when they start afresh).
    """

    def __init__(self, endpoint: PsEndpoint, rank: int, attempt: int, start_clock: int = 0) -> None:
        self.endpoint = endpoint
        self.rank = rank
        self.attempt = attempt
        self.start_clock = start_clock
        self.stats = ClientStats()
        shards = len(endpoint.shard_params)
        self._channels = [self._connect() for _ in range(shards)]
        self._pool = ThreadPoolExecutor(max_workers=shards, thread_name_prefix="sparkdl-ps-client")

    def _connect(self) -> Channel:
        try:
            sock = socket.create_connection((self.endpoint.host, self.endpoint.port), timeout=30)
        except OSError as exc:
            raise PsClientError(
                f"rank {self.rank}: cannot reach the parameter server at "
                f"{self.endpoint.host}:{self.endpoint.port} ({exc}); executors must reach the driver "
                "on spark.driver.host"
            ) from exc
        sock.settimeout(self.endpoint.timeout_s + 30)  # the server answers a stuck pull itself
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = client_hello(sock, self.endpoint.secret, self.rank, self.attempt, self.start_clock)
        self._expect(channel, Kind.ACK)
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
        self.stats.pushes += 1

    def pull(self, clock: int) -> list[tuple[int, torch.Tensor]]:
        """(version, flat weights) of every shard for a worker about to compute ``clock``."""
        started = time.perf_counter()
        futures = [self._pool.submit(self._pull_one, shard, clock) for shard in range(len(self._channels))]
        results = []
        for future in futures:
            sent, received, version, weights = future.result()
            self.stats.bytes_sent += sent
            self.stats.bytes_received += received
            results.append((version, weights))
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
        return self._expect(channel, Kind.ACK).clock

    def abort(self, reason: str) -> None:
        """Tell the server this worker stops: every other worker's next pull or push fails."""
        channel = self._channels[0]
        channel.send(Frame(Kind.ABORT, 0, self.rank, self.attempt, payload=reason.encode()[:4000]))
        self._expect(channel, Kind.ACK)

    def _push_one(self, shard: int, clock: int, rows: int, grad: torch.Tensor) -> tuple[int, int]:
        """Runs on a pool thread: returns (bytes sent, staleness the server measured)."""
        channel = self._channels[shard]
        frame = Frame(Kind.PUSH, shard, self.rank, self.attempt, clock, rows, grad.contiguous().numpy().data)
        sent = channel.send(frame)
        return sent, self._expect(channel, Kind.ACK).clock

    def _pull_one(self, shard: int, clock: int) -> tuple[int, int, int, torch.Tensor]:
        """Runs on a pool thread: returns (bytes sent, bytes received, version, weights)."""
        channel = self._channels[shard]
        sent = channel.send(Frame(Kind.PULL, shard, self.rank, self.attempt, clock))
        reply = self._expect(channel, Kind.WEIGHTS)
        weights = torch.from_numpy(np.frombuffer(reply.payload, dtype=np.float32))
        return sent, len(reply.payload), reply.clock, weights

    def _expect(self, channel: Channel, kind: Kind) -> Frame:
        try:
            frame = channel.recv(self.endpoint.max_payload)
        except (ProtocolError, OSError) as exc:
            raise PsClientError(f"rank {self.rank}: parameter server connection failed: {exc}") from exc
        if frame.kind is Kind.ERROR:
            reason = bytes(frame.payload).decode(errors="replace")
            if reason.startswith("aborted: "):
                raise agreed(PeerStopped(f"rank {self.rank}: {reason.removeprefix('aborted: ')}"))
            if "waited" in reason:
                raise PsTimeoutError(reason)
            raise PsClientError(f"rank {self.rank}: parameter server refused the request: {reason}")
        if frame.kind is not kind:
            raise PsClientError(
                f"rank {self.rank}: expected {kind.name} from the server, got {frame.kind.name}"
            )
        return frame

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for channel in self._channels:
            channel.sock.close()
