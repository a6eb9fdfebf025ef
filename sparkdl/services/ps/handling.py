"""The parameter server's answer to one request of a worker: PUSH, PULL, ABORT, SNAPSHOT.

Shards are served in parallel: a request touches only its own shard's store (each has its
own lock), except an ABORT, which stops every shard.

Errors. A request that fails is answered with an ERROR frame whose code names the error
(:class:`sparkdl.services.ps.protocol.ErrorCode`); a rejected push (stale attempt,
duplicate clock, wrong size or dtype, a NaN or infinite value) is counted and logged. A
request the protocol does not allow (a shard that does not exist, a shared area not its
connection's, a pull in an encoding not served, a kind a worker does not send) raises
:class:`ProtocolError` instead: its connection is closed.

Shared memory. A PUSH or PULL that names its connection's shared-memory area
(:mod:`sparkdl.comm.ps_areas`) has its payload there: the gradient is read from the area,
the weights are written into it and only the WEIGHTS header is sent.

Parked pulls. A pull through shared memory of a shard of at most ``park_max_values``
values, in sync or ssp mode, that must wait is parked (:mod:`sparkdl.services.ps.parking`)
rather than waited for; every push (and an abort) then answers the shard's parked pulls it
made answerable. Any other pull waits on its connection's thread (``store.pull``).
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Sequence

import numpy as np
import torch

from sparkdl.comm.compression.codecs import Codec
from sparkdl.comm.ps_areas import ServerAreas
from sparkdl.config import PsMode
from sparkdl.errors import CheckpointError, ParameterServerError, ProtocolError, PushRejected
from sparkdl.services.ps.connection import Park, WarmBuffers
from sparkdl.services.ps.factored import FACTORS, FactorLayout
from sparkdl.services.ps.parking import ParkedPulls
from sparkdl.services.ps.protocol import BF16, FLOAT32, MAX_ERROR_BYTES, Frame, Kind, error_frame
from sparkdl.services.ps.served_attempt import StageAttempts
from sparkdl.services.ps.store import ShardStore, all_finite
from sparkdl.services.worker_lines import WorkerLines
from sparkdl.wire.refusals import Refusals, one_line

log = logging.getLogger(__name__)


class RequestHandler:
    """Answers the requests of every connection, on each connection's own thread.

    Args:
        stores: one :class:`ShardStore` per shard.
        areas: the server's shared memory (None: payloads travel in the frames).
        codecs: the compressed pushes the server decodes, by their code.
        layouts: each shard's layout for pushes that carry factors (None: the server takes none).
        timeout_s: how long a pull may wait (``runtime.ps_timeout_s``).
        park_max_values: the largest shard whose pulls through shared memory are parked.
        attempts: the stage attempts, which save the shards' snapshots.
        refusals: where rejected pushes and undeliverable answers are counted and logged.
    """

    def __init__(
        self,
        stores: Sequence[ShardStore],
        areas: ServerAreas | None,
        codecs: dict[int, Codec],
        timeout_s: float,
        park_max_values: int,
        attempts: StageAttempts,
        refusals: Refusals,
        layouts: Sequence[FactorLayout] | None = None,
    ) -> None:
        self.stores = stores
        self._layouts = layouts
        self._areas = areas
        self._codecs = codecs
        self._timeout_s = timeout_s
        self._park_max_values = park_max_values
        self._attempts = attempts
        self._refusals = refusals
        self.rejected: collections.deque[str] = collections.deque(maxlen=100)  # the latest reasons
        self.rejected_pushes = 0
        self._nonfinite_values = 0  # pushes whose gradient or loss was NaN or infinite
        self.parked = ParkedPulls(stores, timeout_s, self._try_weights, refusals)
        # a rank's ABORTs each log a line: at most a burst, then a steady rate (a secret holder's flood)
        self.stop_lines = WorkerLines(max((s.num_workers for s in stores), default=0), log, "stop reasons")

    @property
    def nonfinite_pushes(self) -> int:
        """Pushes refused for NaN or infinite values, or for an update that left a weight so."""
        return self._nonfinite_values + sum(store.nonfinite_updates for store in self.stores)

    def handle(self, frame: Frame, warm: WarmBuffers, park: Park | None = None) -> Frame | None:
        """The answer to one request: its result, or an ERROR frame with the error's code;
        None when a pull was parked (``park``: its channel, and the answers that go ahead of it)."""
        if not 0 <= frame.shard < len(self.stores):
            raise ProtocolError(f"shard {frame.shard} does not exist (the server has {len(self.stores)})")
        try:
            reply = self._answer(frame, warm, park)
        except (ParameterServerError, CheckpointError) as exc:
            if isinstance(exc, PushRejected):
                self.reject(("rank", frame.rank), str(exc))
            reply = error_frame(exc, frame.shard)
        return reply

    def reject(self, peer: tuple[str, int] | tuple[str, int | str], reason: str) -> None:
        """Count and log a rejected push or stage attempt."""
        self.rejected_pushes += 1
        self.rejected.append(reason)
        self._refusals.add("request rejected", peer, reason)

    def _answer(self, frame: Frame, warm: WarmBuffers, park: Park | None) -> Frame | None:
        if frame.area and (warm.area is None or frame.area != warm.area + 1):
            raise ProtocolError(
                f"a {frame.kind.name} frame names shared area {frame.area - 1}, the connection holds "
                f"{'none' if warm.area is None else warm.area}"
            )
        if frame.kind is Kind.PUSH:
            return self._push(frame, warm)
        if frame.kind is Kind.PULL:
            return self._pull(frame, warm, park)
        if frame.kind is Kind.ABORT:
            return self._abort(frame)
        if frame.kind is Kind.SNAPSHOT:
            version = self._attempts.save_snapshot(frame.shard, frame.clock)
            return Frame(Kind.ACK, shard=frame.shard, version=version)
        raise ProtocolError(f"unexpected {frame.kind.name} frame from a worker")

    def _push(self, frame: Frame, warm: WarmBuffers) -> Frame:
        store = self.stores[frame.shard]
        grad = self._gradient(frame, store.numel, warm.area if frame.area else None)
        if not all_finite(grad):
            self._nonfinite_values += 1
            raise PushRejected(
                f"push to shard {frame.shard} at clock {frame.clock} holds NaN or infinite values; "
                "it was not applied (the worker's own NaN guard should have skipped that step)"
            )
        if not math.isfinite(frame.loss):
            self._nonfinite_values += 1
            raise PushRejected(
                f"push to shard {frame.shard} at clock {frame.clock} carries a loss of {frame.loss}; it was "
                "not applied (the line search cannot compare a non-finite objective)"
            )
        try:
            # an independent task's PUSH carries its dropped rows where an ACK carries staleness
            dropped = frame.staleness if store.independent else 0
            staleness = store.push(
                frame.rank, frame.attempt, frame.clock, frame.rows, grad, frame.loss, dropped
            )
        finally:  # an update undone still passed its clock: the pulls parked for it go on
            self.parked.answer(frame.shard)
        return Frame(Kind.ACK, shard=frame.shard, staleness=staleness)

    def _pull(self, frame: Frame, warm: WarmBuffers, park: Park | None) -> Frame | None:
        store = self.stores[frame.shard]
        if frame.dtype not in (FLOAT32, BF16):
            raise ProtocolError(f"pull of shard {frame.shard} in encoding {frame.dtype}: fp32 or bf16 only")
        if (
            park is None
            or not frame.area
            or store.mode is PsMode.ASYNC
            or store.independent  # ssp over live tasks: a task's end, not a push, may answer it
            or store.numel > self._park_max_values
            or store.coordinated  # its versions come from the coordinator's thread, not a push
        ):
            return self._weights(frame, warm, wait=True)
        return self.parked.park(frame, warm, park)

    def _abort(self, frame: Frame) -> Frame:
        reason = one_line(bytes(frame.payload).decode(errors="replace"), MAX_ERROR_BYTES)
        if self.stop_lines.admit(frame.rank):
            log.warning("parameter server: rank %d stopped: %s", frame.rank, reason)
        for shard, each in enumerate(self.stores):
            each.abort(f"rank {frame.rank} stopped: {reason}")
            self.parked.answer(shard)
        return Frame(Kind.ACK, shard=frame.shard)

    def _try_weights(self, pull: Frame, warm: WarmBuffers) -> Frame | None:
        return self._weights(pull, warm, wait=False)

    def _weights(self, pull: Frame, warm: WarmBuffers, wait: bool) -> Frame | None:
        """The WEIGHTS answer to ``pull`` (in the connection's area when it names it, in the
        encoding it asks for); None when it must wait and ``wait`` is False."""
        store = self.stores[pull.shard]
        area = None  # the worker's area, in the encoding it asked for
        if pull.area:
            assert self._areas is not None and warm.area is not None
            dtype = torch.float32 if pull.dtype == FLOAT32 else torch.bfloat16
            area = self._areas.weights_area(warm.area, store.numel, dtype)
        out = area if area is not None and pull.dtype == FLOAT32 else warm.weights(store.numel)
        if wait:
            version, weights = store.pull(pull.rank, pull.clock, self._timeout_s, out)
        else:
            pulled = store.try_pull(pull.rank, pull.clock, out)
            if pulled is None:
                return None
            version, weights = pulled
        if store.finished:
            return Frame(Kind.FINISHED, shard=pull.shard, version=version)
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

    def _gradient(self, frame: Frame, numel: int, area: int | None) -> torch.Tensor:
        """The float32 gradient a PUSH carries, plain or compressed (the frame's dtype), in
        the frame or in the connection's shared ``area``."""
        if frame.dtype == FACTORS:
            return self._factored(frame, area)
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
            assert self._areas is not None
            data = self._areas.push_area(area, expected)  # fits: the area takes the largest push
        else:
            data = torch.from_numpy(np.frombuffer(frame.payload, dtype=np.uint8))
        if codec is None:
            return data.view(torch.float32)
        try:
            return codec.decode(data, numel)
        except ValueError as exc:  # a malformed payload (a top-k index out of range)
            raise PushRejected(f"push to shard {frame.shard} in {codec.name} does not decode: {exc}") from exc

    def _factored(self, frame: Frame, area: int | None) -> torch.Tensor:
        """The gradient a PUSH of sufficient factors carries, rebuilt (always in the frame)."""
        if self._layouts is None:
            raise PushRejected(
                f"push to shard {frame.shard} carries sufficient factors, which this server was not "
                "started to take (runtime.sufficient_factors = 'off' on the driver)"
            )
        if area is not None:
            raise ProtocolError("a PUSH of sufficient factors names a shared area; it travels in the frame")
        data = torch.from_numpy(np.frombuffer(frame.payload, dtype=np.uint8))
        try:
            return self._layouts[frame.shard].decode(data)
        except ValueError as exc:
            raise PushRejected(f"push of factors to shard {frame.shard} does not decode: {exc}") from exc
