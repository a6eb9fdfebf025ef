"""What a collective sends: the bytes one worker puts on the wire, for the traffic counters,
and the shapes of exchange a strategy declares for the cost model to price."""

from __future__ import annotations

import enum


class Pattern(str, enum.Enum):
    """How a strategy's exchange uses the network: what :mod:`sparkdl.advisor.costmodel`
    prices. A strategy declares its own (``SyncStrategy.pattern``)."""

    #: every step, a ring all-reduce of the gradients, overlapped with backward (DDP)
    RING_OVERLAPPED = "ring_overlapped"
    #: every ``tau`` steps, a ring all-reduce of the weights (and optimizer state), not overlapped
    RING_PERIODIC = "ring_periodic"
    #: every step, each worker pushes to one server and pulls back: the server's link carries all
    STAR = "star"


def ring_allreduce_bytes(payload: int, world_size: int) -> int:
    """Bytes one worker sends in a ring all-reduce of ``payload`` bytes.

    A ring all-reduce is a reduce-scatter then an all-gather, each moving
    ``(world_size - 1) / world_size`` of the payload out of every worker.
    """
    return 0 if world_size <= 1 else 2 * (world_size - 1) * payload // world_size
