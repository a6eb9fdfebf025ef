"""The parameter server's socket side: one listening socket on the driver, a thread per
worker connection, shards served in parallel (each shard has its own lock).

Every connection must open with an authenticated HELLO. A frame that fails
authentication, is truncated, or announces an oversized payload closes that
connection (and is logged with the peer's address); the other workers are not
affected. A request that fails is answered with an ERROR frame whose code names the
error (:class:`sparkdl.ps.protocol.ErrorCode`); a rejected push (stale attempt,
duplicate clock, wrong size or dtype) is also logged.

Snapshots. With a checkpoint directory, rank 0 asks every shard for a SNAPSHOT
right before it writes the worker checkpoint of global step ``s``; each shard
writes ``ps-shard-NNN-<s>.pt`` there (atomically, newest two kept). A stage attempt
whose HELLO says it resumes from step ``s`` first returns every shard to its
snapshot of ``s``: the state that checkpoint was taken with.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence

import numpy as np
import torch

from sparkdl.checkpoint import CheckpointStore
from sparkdl.errors import (
    CheckpointError,
    ConnectionClosed,
    ParameterServerError,
    ProtocolError,
    PushRejected,
)
from sparkdl.net.listener import ConnectionListener, close_quietly
from sparkdl.ps.endpoint import PsEndpoint
from sparkdl.ps.protocol import FLOAT32, Frame, Kind, PsChannel, error_frame, server_hello
from sparkdl.ps.store import ShardStore

log = logging.getLogger(__name__)


class ParameterServer:
    """Serves ``stores`` on ``(host, port 0)`` until :meth:`stop`.

    Args:
        stores: one :class:`ShardStore` per shard.
        host: address to bind (the driver's address that executors reach).
        secret: per-fit HMAC key.
        timeout_s: how long a pull may wait (``runtime.ps_timeout_s``).
        max_payload: frame payload cap in bytes.
        snapshot_dir: where shards write their snapshots ("" = snapshots refused).
    """

    def __init__(
        self,
        stores: Sequence[ShardStore],
        host: str,
        secret: bytes,
        timeout_s: float,
        max_payload: int,
        snapshot_dir: str = "",
    ) -> None:
        self.stores = list(stores)
        self._snapshots = [
            CheckpointStore(snapshot_dir, name=f"ps-shard-{i:03d}") if snapshot_dir else None
            for i in range(len(self.stores))
        ]
        self._attempt: int | None = None  # the stage attempt the stores serve now
        self._attempt_lock = threading.Lock()
        self.secret = secret
        self.timeout_s = timeout_s
        self.max_payload = max_payload
        self.rejected: list[str] = []  # reasons, for tests and logs
        self._listener = ConnectionListener(host, self._serve, "sparkdl-ps")
        self.host, self.port = self._listener.host, self._listener.port

    def endpoint(self, shard_params: tuple[tuple[int, ...], ...]) -> PsEndpoint:
        return PsEndpoint(self.host, self.port, self.secret, shard_params, self.timeout_s, self.max_payload)

    def stop(self, timeout: float = 10.0) -> None:
        """Wake waiting pulls, close the port and every connection; join all threads (bounded)."""
        for store in self.stores:
            store.close()
        self._listener.stop(timeout)

    def _serve(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        try:
            hello, channel = server_hello(sock, self.secret)
            try:
                self._begin_attempt(hello.attempt, hello.clock)
            except (PushRejected, CheckpointError) as exc:
                channel.send(error_frame(exc))
                self._reject(peer, str(exc))
                return
            channel.send(Frame(Kind.ACK))
            while not self._listener.stopping:
                self._handle(channel, channel.recv(self.max_payload))
        except ProtocolError as exc:
            if not self._listener.stopping and not isinstance(exc, ConnectionClosed):
                self._reject(peer, str(exc))
        except OSError:
            pass  # the worker went away, or stop() closed the socket
        finally:
            close_quietly(sock)

    def _begin_attempt(self, attempt: int, start_clock: int) -> None:
        """The first connection of a new stage attempt restarts the clocks (and restores
        the snapshot of ``start_clock`` when the workers resumed from a checkpoint)."""
        with self._attempt_lock:
            if self._attempt is not None and attempt <= self._attempt:
                if attempt < self._attempt:
                    raise PushRejected(f"stage attempt {attempt} is older than the current {self._attempt}")
                return
            states = [
                self._load_snapshot(i, start_clock) if start_clock else None for i in range(len(self.stores))
            ]
            for store, state in zip(self.stores, states, strict=True):
                store.begin_attempt(attempt, start_clock, state)
            self._attempt = attempt
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

    def _handle(self, channel: PsChannel, frame: Frame) -> None:
        """Answer one request: its result, or an ERROR frame with the error's code."""
        if not 0 <= frame.shard < len(self.stores):
            raise ProtocolError(f"shard {frame.shard} does not exist (the server has {len(self.stores)})")
        try:
            reply = self._answer(frame)
        except (ParameterServerError, CheckpointError) as exc:
            if isinstance(exc, PushRejected):
                self._reject(("rank", frame.rank), str(exc))
            reply = error_frame(exc, frame.shard)
        channel.send(reply)

    def _answer(self, frame: Frame) -> Frame:
        store = self.stores[frame.shard]
        if frame.kind is Kind.PUSH:
            if frame.dtype != FLOAT32 or len(frame.payload) != store.numel * 4:
                raise PushRejected(
                    f"push of {len(frame.payload)} bytes (dtype code {frame.dtype}) to shard "
                    f"{frame.shard}, which takes {store.numel * 4} bytes of float32"
                )
            grad = torch.from_numpy(np.frombuffer(frame.payload, dtype=np.float32))
            staleness = store.push(frame.rank, frame.attempt, frame.clock, frame.rows, grad)
            return Frame(Kind.ACK, shard=frame.shard, staleness=staleness)
        if frame.kind is Kind.PULL:
            version, weights = store.pull(frame.rank, frame.clock, self.timeout_s)
            return Frame(Kind.WEIGHTS, shard=frame.shard, version=version, payload=weights.numpy().data)
        if frame.kind is Kind.ABORT:
            reason = bytes(frame.payload).decode(errors="replace")
            log.warning("parameter server: rank %d stopped: %s", frame.rank, reason)
            for each in self.stores:
                each.abort(f"rank {frame.rank} stopped: {reason}")
            return Frame(Kind.ACK, shard=frame.shard)
        if frame.kind is Kind.SNAPSHOT:
            version = self._save_snapshot(frame.shard, frame.clock)
            return Frame(Kind.ACK, shard=frame.shard, version=version)
        raise ProtocolError(f"unexpected {frame.kind.name} frame from a worker")

    def _reject(self, peer: tuple[str, int] | tuple[str, int | str], reason: str) -> None:
        log.warning("parameter server refused %s: %s", peer, reason)
        self.rejected.append(reason)
