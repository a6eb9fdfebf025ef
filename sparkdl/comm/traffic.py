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
    #: every step, the parameters all-gathered twice (forward, backward) and the gradients
    #: reduce-scattered, overlapped with compute (fsdp)
    FULL_SHARD = "full_shard"
    #: every micro-batch, the activations at each cut to the next stage and their gradients
    #: back; the replicas of a stage all-reduce its gradients after the step
    PIPELINE = "pipeline"
    #: every step, each split layer pair all-reduces its output (forward) and its input's
    #: gradient (backward) within a group; the groups all-reduce the gradients after the step
    TENSOR = "tensor"


def ring_allreduce_bytes(payload: int, world_size: int) -> int:
    """Bytes one worker sends in a ring all-reduce of ``payload`` bytes.

    A ring all-reduce is a reduce-scatter then an all-gather, each moving
    ``(world_size - 1) / world_size`` of the payload out of every worker.
    """
    return 0 if world_size <= 1 else 2 * (world_size - 1) * payload // world_size


def factors_pay(rows: int, inputs: int, outputs: int, world: int) -> bool:
    """Whether ``rows`` rows of factors cost one worker fewer bytes than the ``outputs x inputs``
    matrix: a ring all-gather of ``rows (inputs + outputs)`` per worker against a ring all-reduce
    of ``inputs outputs`` (:mod:`sparkdl.comm.factors`)."""
    return world > 1 and world * rows * (inputs + outputs) < 2 * inputs * outputs


def fewer_values(rows: int, inputs: int, outputs: int) -> bool:
    """Whether ``rows`` rows of factors are fewer values than the ``outputs x inputs`` matrix:
    when a parameter server's push carries them (the worker's choice, and the server's bound)."""
    return rows * (inputs + outputs) < inputs * outputs
