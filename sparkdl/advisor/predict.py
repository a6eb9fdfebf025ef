"""The strategy advisor's arithmetic: from what a probe measured on the real cluster to
predicted samples/s for each strategy, tau and compression, and a recommendation.

Pure (no Spark, no torch). The probe (:mod:`sparkdl.worker.probe`) trains a few steps
of each *probed* candidate on the cluster, with the real training loop, feed and
strategy, on the first rows of every partition, and times them; the other candidates
are *modelled* from a probed one by what changes between them:

- weight averaging every ``tau`` steps: ``step(tau) = c + d / tau``, fitted through the
  probed ``tau = 1`` and ``tau = 4`` (``d`` is the average, and the wait for the workers'
  drift apart over a period, which a local step's figure alone misses), and ``1/tau`` of
  ``tau = 1``'s bytes;
- the asynchronous parameter server pushing and pulling every ``k`` steps: the same
  ``c + d / k`` through the probed ``k = 1`` and ``k = 4`` (from ``k = 1`` alone, ``1/k``
  of its round trip came out 25% slow on a shared 1 Gbit/s link: exchanges that no longer
  coincide do not queue behind each other);
- the stale-synchronous parameter server: between the synchronous and the asynchronous
  one (it waits only for a worker more than ``staleness`` clocks behind; with workers of
  equal speed it runs close to sync, with a straggler close to async).

A run's epoch is then ``steps x step_s`` plus the epoch's own overhead (the feed's start,
the end-of-epoch all-reduce), both measured, for the run's rows: predicted samples/s is
what ``history`` reports as ``samples_per_s`` from the second epoch on (the first streams
from Spark). The link's latency and bandwidth (measured by all-reducing a tiny tensor and
one of the model's size) feed :mod:`sparkdl.advisor.costmodel` to project the same run to more
workers.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparkdl.advisor.probed import LOCAL, LinkEstimate, ProbeResult, Timing
from sparkdl.advisor.projection import project
from sparkdl.comm.traffic import Pattern
from sparkdl.config import Strategy

__all__ = [  # what the probe measured lives in probed.py; predictions speak it
    "LOCAL",
    "Advice",
    "Candidate",
    "Derived",
    "LinkEstimate",
    "Prediction",
    "ProbeResult",
    "Timing",
    "predict",
    "probe_set",
]

#: Weight averaging (tau) and the asynchronous parameter server (push/pull every k) are
#: probed at 1 and at this many steps per exchange; other counts follow from the two.
FIT_AT = 4
#: Exact candidates within this share of the fastest count as tied; the first of
#: PREFERENCE among them is recommended: all-reduce (the default, nothing else to run),
#: fsdp (no server either), the synchronous parameter server (a server on the driver).
TIE = 0.1
#: The all-reduce row that aggregates within each host first (probed on clusters of several hosts).
HOST_HIERARCHY = "allreduce hierarchy=host"
PREFERENCE = ("allreduce", HOST_HIERARCHY, "fsdp", "parameter_server sync")


@dataclass(frozen=True)
class Candidate:
    """A strategy setting to predict: its name (as in docs/benchmarks/history.md) and its settings,
    applied over the estimator's own."""

    name: str
    settings: Mapping[str, Any]
    exact: bool = True  # computes the same step as single-process SGD on the global batch


class Model(str, enum.Enum):
    """How a modelled candidate follows from the probed ones."""

    FIT = "fit"  # step(k) = c + d / k through the parent at k = 1 and ``other`` at FIT_AT
    BETWEEN = "between"  # the mean of the parent's and ``other``'s figures


@dataclass(frozen=True)
class Derived:
    """A candidate modelled from two probed ones, ``parent`` and ``other`` (see :class:`Model`)."""

    candidate: Candidate
    model: Model
    parent: str
    other: str
    factor: int = 1  # FIT: the steps per exchange of the candidate


def _candidate(name: str, exact: bool = False, **settings: Any) -> Candidate:
    return Candidate(name, {"compression": "none", "sufficient_factors": "off", **settings}, exact)


def _ps(name: str, mode: str, exact: bool = False, **settings: Any) -> Candidate:
    # pinned: the user's backup workers and bf16 pulls would make a "sync" row inexact
    pinned = {"backup_workers": 0, "ps_pull_precision": "fp32", **settings}
    return _candidate(name, exact, strategy="parameter_server", ps_mode=mode, **pinned)


def _wa(tau: int, compression: str = "none") -> Candidate:
    suffix = "" if compression == "none" else f" {compression}"
    name = f"weight_averaging tau={tau}{suffix}"
    return _candidate(name, strategy="weight_averaging", sync_every=tau, compression=compression)


def _async_every(k: int) -> Candidate:
    name = "parameter_server async" + (f" push/pull every {k}" if k > 1 else "")
    return _ps(name, "async", push_every=k, pull_every=k)


def probe_set(tau: int, staleness: int, every: int, hosts: int = 1) -> tuple[list[Candidate], list[Derived]]:
    """The candidates the probe trains, and those modelled from them.

    Exact candidates take single-process SGD's step on the global batch whatever the
    optimizer: all-reduce, fsdp, pipeline, tensor and the synchronous parameter server
    (fp32 pulls, no backup workers); all-reduce and that server also with sufficient
    factors (``auto``: on the layers where they send fewer bytes). Weight averaging at tau 1
    is exact only with plain SGD, which the advisor cannot see in an ``optimizer_fn``, so it
    does not count as exact.

    Args:
        tau: the estimator's ``sync_every`` (modelled besides 8 and 16; 1 and 4 are probed).
        staleness: the estimator's ``staleness`` (the ssp row's bound; 0 counts as 2).
        every: the estimator's ``push_every`` (a modelled async row when not 1 or 4, probed).
        hosts: the hosts the workers span; on more than one, all-reduce is also probed with
            ``hierarchy = "host"`` (each host's workers sum in its shared memory, one leader per
            host crosses the network: 1.4-1.6x flat across 2 hosts, BENCHMARKS.md).
    """
    host_level = (
        [_candidate(HOST_HIERARCHY, exact=True, strategy="allreduce", hierarchy="host")] if hosts > 1 else []
    )
    probed = [
        _candidate(LOCAL, strategy="weight_averaging", sync_every=1 << 30, wa_backup_workers=0),
        _candidate("allreduce", exact=True, strategy="allreduce"),
        _candidate("allreduce fp16", strategy="allreduce", compression="fp16"),
        _candidate("allreduce 1bit", strategy="allreduce", compression="1bit"),
        _candidate(
            "allreduce, sufficient factors", exact=True, strategy="allreduce", sufficient_factors="auto"
        ),
        *(_wa(t, c) for t in (1, FIT_AT) for c in ("none", "1bit")),
        _ps("parameter_server sync", "sync", exact=True),
        _ps("parameter_server sync 1bit", "sync", compression="1bit"),
        _ps("parameter_server sync 1bit, bf16 pulls", "sync", compression="1bit", ps_pull_precision="bf16"),
        _ps("parameter_server sync, sufficient factors", "sync", exact=True, sufficient_factors="auto"),
        _async_every(1),
        _async_every(FIT_AT),
        *host_level,
        _candidate("fsdp", exact=True, strategy="fsdp"),
        _candidate("pipeline", exact=True, strategy="pipeline"),
        _candidate("tensor", exact=True, strategy="tensor"),
    ]
    derived = [
        Derived(_wa(t, c), Model.FIT, _wa(1, c).name, _wa(FIT_AT, c).name, t)
        for t in sorted({8, 16, tau} - {1, FIT_AT})
        for c in ("none", "1bit")
    ]
    s = staleness or 2
    ssp = _ps(f"parameter_server ssp s={s}", "ssp", staleness=s)
    derived.append(Derived(ssp, Model.BETWEEN, "parameter_server sync", "parameter_server async"))
    derived += [
        Derived(_async_every(k), Model.FIT, _async_every(1).name, _async_every(FIT_AT).name, k)
        for k in sorted({every} - {1, FIT_AT})
    ]
    return probed, derived


@dataclass(frozen=True)
class Prediction:
    """One row of the advice: a candidate's predicted samples/s for the run."""

    name: str
    settings: Mapping[str, Any]
    samples_per_s: float
    epoch_s: float
    bytes_per_step: float  # sent per worker
    source: str  # "measured", or what it was modelled from
    exact: bool


@dataclass
class Advice:
    """The advisor's answer: every prediction (fastest first), what it could not predict,
    and the recommendation."""

    rows: list[Prediction]
    skipped: dict[str, str]
    total_rows: int
    probe: ProbeResult
    projections: dict[str, dict[int, float]] = field(default_factory=dict)
    unit: str = "epoch"  # what a row's seconds time: an epoch, or one pass of full-batch L-BFGS
    preference: tuple[str, ...] = PREFERENCE  # among tied exact rows, the first of these
    note: str = ""  # said after the summary

    @property
    def recommended(self) -> Prediction:
        """The fastest candidate that takes the same step as all-reduce (the safe choice);
        within ``TIE`` of it, the simplest to run by ``preference``: the probe's figures
        are no finer than that. Without an exact candidate among the rows (``strategies``
        left none), the fastest."""
        exact = [row for row in self.rows if row.exact]
        if not exact:
            return self.rows[0]
        best = exact[0]
        close = {row.name: row for row in exact if row.samples_per_s >= (1 - TIE) * best.samples_per_s}
        return next((close[name] for name in self.preference if name in close), best)

    @property
    def fastest(self) -> Prediction:
        """The fastest candidate of all (some change the optimisation: tau, compression, async)."""
        return self.rows[0]

    def prediction(self, name: str) -> Prediction:
        """The row called ``name`` (as in the table)."""
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no prediction named {name!r}; the rows are {[r.name for r in self.rows]}")

    def summary(self) -> str:
        """One paragraph: what to set, and what the faster approximate choice would give."""
        best, fastest = self.recommended, self.fastest
        how = "the same step as all-reduce" if best.exact else "no candidate probed takes all-reduce's step"
        text = (
            f"recommended: {_settings_text(best.settings)} ({best.name}: {best.samples_per_s:,.0f} "
            f"samples/s predicted, {how})"
        )
        if fastest is not best and fastest.samples_per_s > 1.2 * best.samples_per_s:
            text += (
                f"; {fastest.name} is predicted {fastest.samples_per_s / best.samples_per_s:.1f}x "
                f"faster ({_settings_text(fastest.settings)}) but changes the optimisation "
                "(local steps, compression or stale gradients): check its accuracy on a held-out set"
            )
        return f"{text}; {self.note}" if self.note else text

    def table(self) -> str:
        """The predictions as a text table, fastest first."""
        per = "step" if self.unit == "epoch" else self.unit  # what bytes_per_step counts
        digits = 2 if self.unit == "epoch" else 4  # an L-BFGS pass may take milliseconds
        lines = [
            f"{'candidate':<44} {'samples/s':>11} {self.unit + ' s':>9} {'MB/' + per:>9}  source",
        ]
        for row in self.rows:
            lines.append(
                f"{row.name:<44} {row.samples_per_s:>11,.0f} {row.epoch_s:>9.{digits}f} "
                f"{row.bytes_per_step / 1e6:>9.3f}  {row.source}"
            )
        for name, why in self.skipped.items():
            lines.append(f"{name:<44} {'-':>11} {'-':>9} {'-':>9}  not probed: {why}")
        link, megabytes = self.probe.link, 4 * self.probe.params / 1e6
        if link.bytes_per_s > 0:
            lines.append(
                f"link: {link.latency_s * 1e6:,.0f} us per message, {link.bytes_per_s * 8 / 1e9:.2f} "
                f"Gbit/s per worker (all-reduces of one float and of the model's {megabytes:.3g} MB)"
            )
        else:
            lines.append("link: not measured (one worker: nothing crosses it)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": [row.__dict__ | {"settings": dict(row.settings)} for row in self.rows],
            "skipped": self.skipped,
            "recommended": self.recommended.name,
            "unit": self.unit,  # what each row's epoch_s times: an epoch, or an L-BFGS pass
            "full_batch": {  # with optimizer = "lbfgs": what its passes add, as the probe timed it
                "gradient_sum_s": self.probe.gradient_sum_s,
                "vector_op_s": self.probe.vector_op_s,
            },
            "fastest": self.fastest.name,
            "link": self.probe.link.__dict__,
            "probe": {name: timing.__dict__ for name, timing in self.probe.timings.items()},
            "projections": {k: {str(n): v for n, v in p.items()} for k, p in self.projections.items()},
        }

    def __str__(self) -> str:
        return f"{self.table()}\n{self.summary()}"


def predict(
    probe: ProbeResult,
    probed: Sequence[Candidate],
    derived: Iterable[Derived],
    total_rows: int,
    project_to: Sequence[int] = (),
    steps: int = 0,
    patterns: Mapping[Strategy, Pattern | None] | None = None,
) -> Advice:
    """Predicted samples/s of every candidate for a run over ``total_rows`` rows, ``steps``
    a worker per epoch (0: balanced partitions, ``total_rows / (workers x batch)``), and
    their projections to ``project_to`` workers for the strategies whose exchange
    ``patterns`` says how to price (each strategy class's own ``pattern``).

    Raises:
        ValueError: the probe has no timing of the local step (nothing to model from).
    """
    if LOCAL not in probe.timings:
        raise ValueError(f"the probe has no {LOCAL!r} timing: {probe.skipped.get(LOCAL, 'not run')}")
    steps = steps or max(math.ceil(total_rows / (probe.workers * probe.batch_size)), 1)
    local = probe.timings[LOCAL]
    timed = {
        c.name: (c, probe.timings[c.name]) for c in probed if c.name in probe.timings and c.name != LOCAL
    }
    rows = [_row(c, t, steps, total_rows, "measured") for c, t in timed.values()]
    skipped = {c.name: probe.skipped.get(c.name, "not run") for c in probed if c.name not in probe.timings}
    for d in derived:
        parent, other = probe.timings.get(d.parent), probe.timings.get(d.other)
        if parent is None or other is None:
            missing = d.parent if parent is None else d.other
            skipped[d.candidate.name] = f"modelled from {missing!r}, which was not probed"
            continue
        timing = _modelled(d, parent, other, local)
        source = f"modelled: between {d.parent} and {d.other}"
        if d.model is Model.FIT:
            source = f"modelled: c + d/k through {d.parent} and {d.other}"
        rows.append(_row(d.candidate, timing, steps, total_rows, source))
    rows.sort(key=lambda r: -r.samples_per_s)
    if not rows:
        raise ValueError(f"the probe trained no candidate: {skipped}")
    advice = Advice(rows, skipped, total_rows, probe)
    advice.projections = project(probe, project_to, patterns or {}) if project_to else {}
    return advice


def _modelled(d: Derived, parent: Timing, other: Timing, local: Timing) -> Timing:
    if d.model is Model.BETWEEN:
        return Timing(
            (parent.step_s + other.step_s) / 2,
            (parent.epoch_overhead_s + other.epoch_overhead_s) / 2,
            (parent.bytes_per_step + other.bytes_per_step) / 2,
        )
    # step(k) = c + e / k through k = 1 and FIT_AT; c no faster than a local step, and then e
    # refitted through FIT_AT (the measured point nearest the rows modelled)
    exchange = max((parent.step_s - other.step_s) / (1 - 1 / FIT_AT), 0.0)
    floor = max(parent.step_s - exchange, local.step_s)
    exchange = max(other.step_s - floor, 0.0) * FIT_AT
    step_s = floor + exchange / d.factor
    return Timing(step_s, other.epoch_overhead_s, parent.bytes_per_step / d.factor)


def _row(candidate: Candidate, timing: Timing, steps: int, total_rows: int, source: str) -> Prediction:
    epoch_s = steps * timing.step_s + timing.epoch_overhead_s
    return Prediction(
        candidate.name,
        candidate.settings,
        total_rows / epoch_s,
        epoch_s,
        timing.bytes_per_step,
        source,
        candidate.exact,
    )


def _settings_text(settings: Mapping[str, Any]) -> str:
    shown = {
        k: v
        for k, v in settings.items()
        if (k, v) not in (("compression", "none"), ("backup_workers", 0), ("sufficient_factors", "off"))
    }
    return ", ".join(f"{k}={v!r}" for k, v in shown.items())
