"""The advisor's projections: what a few strategies would train at more workers than the
probe ran on (one per host), priced by :mod:`sparkdl.advisor.costmodel` from the probe's
local step, link and the model's shape."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sparkdl.advisor.costmodel import Cluster, Link, Workload, step_cost
from sparkdl.advisor.probed import LOCAL, ProbeResult
from sparkdl.comm.traffic import Pattern
from sparkdl.config import Strategy

#: The rows projected to larger clusters: (strategy, compression, tau, sufficient factors) by
#: row name; each strategy's own ``pattern`` says how the cost model prices it.
_PROJECTED = {
    "allreduce": (Strategy.ALLREDUCE, "none", 1, False),
    "allreduce 1bit": (Strategy.ALLREDUCE, "1bit", 1, False),
    "allreduce, sufficient factors": (Strategy.ALLREDUCE, "none", 1, True),
    "weight_averaging tau=4": (Strategy.WEIGHT_AVERAGING, "none", 4, False),
    "parameter_server sync": (Strategy.PARAMETER_SERVER, "none", 1, False),
    "parameter_server sync, sufficient factors": (Strategy.PARAMETER_SERVER, "none", 1, True),
    "fsdp": (Strategy.FSDP, "none", 1, False),
    "pipeline": (Strategy.PIPELINE, "none", 1, False),
    "tensor": (Strategy.TENSOR, "none", 1, False),
}


def project(
    probe: ProbeResult, workers: Sequence[int], patterns: Mapping[Strategy, Pattern | None]
) -> dict[str, dict[int, float]]:
    """Samples/s of a few strategies at ``workers`` workers (one per host), from the probe's
    local step and link through :mod:`sparkdl.advisor.costmodel` (alpha-beta; the real cluster's
    larger rings are assumed to see the same per-link bandwidth); none without a measured
    link (one worker). A pipeline keeps the probe's stages and a tensor-parallel group its
    size (the extra workers are replicas): projected only to multiples of them, and only
    where the model has a cut or a split (its shape says so); sufficient factors only where
    the model has fully connected layers; a candidate the probe skipped (the settings or the
    model refused it) is not projected either."""
    if probe.link.bytes_per_s <= 0:
        return {}
    local = probe.timings[LOCAL]
    link = Link(probe.link.bytes_per_s * 8 / 1e9, probe.link.latency_s)
    shape = probe.shape
    work = Workload(
        params=probe.params,
        compute_s=local.step_s,
        batch=probe.batch_size,
        shape=shape,
        microbatches=probe.microbatches,
        group=probe.group or probe.workers,
        accumulate=probe.accumulate,
    )
    fits = {
        Strategy.PIPELINE: (lambda n: bool(shape.cut_bytes) and n % shape.stages == 0),
        Strategy.TENSOR: (lambda n: shape.split_params > 0 and n % work.group == 0),
    }
    out: dict[str, dict[int, float]] = {}
    for name, (strategy, compression, tau, factors) in _PROJECTED.items():
        pattern = patterns.get(strategy)
        if pattern is None or name in probe.skipped or (factors and not shape.linears):
            continue
        priced = {
            n: step_cost(
                pattern, Cluster(n), link, work, compression=compression, tau=tau, factors=factors
            ).samples_per_s
            for n in workers
            if fits.get(strategy, lambda _: True)(n)
        }
        if priced:
            out[name] = priced
    return out
