"""What a collective sends: the bytes one worker puts on the wire, for the traffic counters."""

from __future__ import annotations


def ring_allreduce_bytes(payload: int, world_size: int) -> int:
    """Bytes one worker sends in a ring all-reduce of ``payload`` bytes.

    A ring all-reduce is a reduce-scatter then an all-gather, each moving
    ``(world_size - 1) / world_size`` of the payload out of every worker.
    """
    return 0 if world_size <= 1 else 2 * (world_size - 1) * payload // world_size
