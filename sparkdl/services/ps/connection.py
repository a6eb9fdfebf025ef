"""What the parameter server keeps for one worker connection between its requests.

A connection's thread reads one request at a time and answers it before it reads the next,
so its memory can be reused from request to request instead of allocated per frame
(:class:`WarmBuffers`): a PUSH is read into the same buffer every time (the store keeps no
reference to it), and a PULL's weights are written into the same tensor (sent before the
next frame is read). The connection's shared-memory area, when it was granted one, and its
parked pull (:class:`Waiting`, see :mod:`sparkdl.services.ps.parking`) live here too: a
parked pull is answered by another connection's thread, which needs this connection's
buffers, area and channel.

``WarmBuffers.waiting`` is set and cleared only under the parked lock of the pull's shard
(:class:`sparkdl.services.ps.parking.ShardParking`); the connection's own thread reads it
without the lock only to learn whether it has to take it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkdl.services.ps.protocol import Frame, Kind, PsChannel
from sparkdl.wire.framing import ReusedBuffer

Park = tuple[PsChannel, list[Frame]]  # where a parked pull's answer goes, and what goes ahead of it


@dataclass
class Waiting:
    """A parked pull: the request, its connection's buffers, channel and the answers that
    leave ahead of it (the ACK of the push before it), and when it times out."""

    pull: Frame
    warm: WarmBuffers
    channel: PsChannel
    before: list[Frame]
    deadline: float


class WarmBuffers:
    """One connection's reused memory (:class:`ReusedBuffer`): what a PUSH is read into (the
    store keeps no reference to it), and the weights a PULL sends (sent before the next
    frame is read); and its shared-memory area, when it has one."""

    def __init__(self) -> None:
        self.area: int | None = None  # the connection's shared-memory area, if it was granted one
        self.waiting: Waiting | None = None  # the connection's parked pull (set and cleared under its lock)
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
