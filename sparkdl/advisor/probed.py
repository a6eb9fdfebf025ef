"""What the advisor's probe measured on the cluster (plain data): each probed candidate's
step and epoch, the link between the workers, and the model's shape."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sparkdl.advisor.costmodel import ModelShape

#: The internal candidate that trains with no communication at all: the compute a step costs.
LOCAL = "local"


@dataclass(frozen=True)
class Timing:
    """One probed candidate on the cluster: seconds per step (the slowest rank's, median of
    the timed epochs), seconds an epoch adds beyond its steps, bytes a worker sent per step."""

    step_s: float
    epoch_overhead_s: float
    bytes_per_step: float


@dataclass(frozen=True)
class LinkEstimate:
    """The workers' network as the probe saw it: latency of one message, and the bandwidth a
    ring all-reduce of the model's size achieved (bytes each worker sent per second)."""

    latency_s: float
    bytes_per_s: float

    @classmethod
    def from_all_reduce(cls, workers: int, tiny_s: float, model_s: float, model_bytes: float) -> LinkEstimate:
        """From the time of an all-reduce of one float (``tiny_s``: latency only) and of one of
        the model's size (``model_s``): a ring of ``N`` sends ``2 (N-1)`` messages and
        ``2 (N-1)/N`` of the model per worker."""
        if workers < 2:  # nothing crossed a link: unknown, not infinite (JSON has no Infinity)
            return cls(latency_s=0.0, bytes_per_s=0.0)
        messages = 2 * (workers - 1)
        sent = 2 * (workers - 1) / workers * model_bytes
        moving = max(model_s - tiny_s, 1e-9)
        return cls(latency_s=tiny_s / messages, bytes_per_s=sent / moving)


@dataclass(frozen=True)
class ProbeResult:
    """What the probe stage measured, and the model's shape for the projections (what its
    pipeline cut and tensor plan send, :mod:`sparkdl.advisor.shape`; a pipeline's
    ``microbatches``, the tensor-parallel ``group``, 0: every worker, and the micro-batches
    of a step, ``accumulate``)."""

    workers: int
    batch_size: int  # rows per worker per step (batch_size x accumulate_steps)
    params: int
    timings: Mapping[str, Timing]
    skipped: Mapping[str, str]  # candidates the probe could not train, and why
    link: LinkEstimate
    shape: ModelShape = field(default_factory=ModelShape)
    microbatches: int = 1
    group: int = 0
    accumulate: int = 1
    # with optimizer = "lbfgs", the slowest rank's: a pass's sums (its totals and its gradient,
    # through the exchange fit forms) and a model-sized vector operation of its algebra
    gradient_sum_s: float = 0.0
    vector_op_s: float = 0.0
