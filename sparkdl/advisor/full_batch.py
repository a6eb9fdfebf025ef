"""The advisor's arithmetic for full-batch L-BFGS (``optimizer = "lbfgs"``): where to keep
its vectors, on every worker (strategy ``allreduce``) or on the parameter server's shards
(``parameter_server``), and what a pass over the data costs in each.

Pure (no Spark, no torch). Both layouts take the same iterates (torch.optim.LBFGS's), so
the choice is time and memory. The probe times the step-wise stand-ins of a pass's parts
on the real cluster: the local step (a batch's forward and backward), and the synchronous
parameter server's step (the same plus a push and a pull of the model); and, on every
worker at once, a pass's sums through the run's own exchange and a vector operation of the
algebra. A pass is then (:func:`sparkdl.advisor.costmodel.full_batch_pass`):

- with the vectors on every worker: each worker's ``k`` batches, the pass's sums (its
  totals, then the gradient: once, after its last batch, so nothing overlaps) as the probe
  timed them through the run's own exchange, and the iteration's vector operations on
  every worker, timed there;
- on the server's shards: the ``k`` batches, the measured push and pull (the parameter
  server's step less the local one), and the same vector operations on the driver, timed
  on the coordinator's torch threads;

and, in both, what an epoch of local steps adds beyond them (the probe's
``epoch_overhead_s``): a pass replays the epoch cache.

Projections to more workers price the sums from the link (:mod:`sparkdl.advisor.costmodel`).

An iteration takes one pass, or more where its line search evaluates again (1.0-1.3 on
smooth problems): the rows are per pass, as ``history``'s ``samples_per_s`` counts them.
Memory is the other half of the choice: ``2 h`` history vectors of the model's size on
every worker, or split over the shards in the driver.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sparkdl.advisor.costmodel import Cluster, Link, Workload, full_batch_pass, lbfgs_vector_ops, ring_share
from sparkdl.advisor.predict import LOCAL, Advice, Candidate, Prediction, ProbeResult
from sparkdl.errors import ConfigError

#: The probed candidate whose step is a local step plus a push and a pull of the model.
SERVED_PROBE = "parameter_server sync"
#: The two layouts, by the row names the advice gives them, and their strategy.
LAYOUTS = {"lbfgs allreduce": "allreduce", "lbfgs parameter_server": "parameter_server"}
#: What the probe trains in place of L-BFGS (it times steps): plain SGD with a step too small
#: to leave finite numbers, on the same model, rows and batch size.
STAND_IN = {"optimizer": "sgd", "lr": 1e-6, "momentum": 0.0, "weight_decay": 0.0}


def chosen_layouts(strategies: Sequence[str] | None) -> list[str]:
    """The layouts ``advise(strategies=...)`` asks for: those whose row name or strategy starts
    with one of ``strategies`` (every one without).

    Raises:
        ConfigError: ``strategies`` names neither (their names listed).
    """
    if not strategies:
        return list(LAYOUTS)
    chosen = [
        name
        for name, strategy in LAYOUTS.items()
        if any(w and (name.startswith(w) or strategy.startswith(w)) for w in strategies)
    ]
    if not chosen:
        raise ConfigError(
            f"advise(strategies=...) got {list(strategies)}; with optimizer = 'lbfgs' the layouts are "
            f"{list(LAYOUTS)} (or their strategies, 'allreduce' and 'parameter_server')"
        )
    return chosen


def full_batch_candidates(layouts: Sequence[str]) -> list[Candidate]:
    """The probe's candidates for the ``layouts`` (row names of :data:`LAYOUTS`): the local
    step always, and the synchronous parameter server where the shards are a layout."""
    stand_in = {"compression": "none", "sufficient_factors": "off", **STAND_IN}
    local = Candidate(LOCAL, {**stand_in, "strategy": "weight_averaging", "sync_every": 1 << 30})
    served = Candidate(
        SERVED_PROBE,
        {
            **stand_in,
            "strategy": "parameter_server",
            "ps_mode": "sync",
            "backup_workers": 0,
            "ps_pull_precision": "fp32",
        },
    )
    return [local, served] if "lbfgs parameter_server" in layouts else [local]


@dataclass(frozen=True)
class FullBatchRun:
    """The L-BFGS run to predict: ``total_rows`` over the workers, ``batches`` a worker per
    pass (its largest partition's), ``history`` pairs, ``shards`` of the parameter server,
    and a model-sized vector operation's seconds on the workers (timed on all at once) and
    on the driver (where the shards' algebra runs)."""

    total_rows: int
    batches: int
    history: int
    shards: int
    worker_op_s: float
    driver_op_s: float

    def vector_op_s(self, served: bool) -> float:
        return self.driver_op_s if served else self.worker_op_s


def predict_full_batch(
    probe: ProbeResult, run: FullBatchRun, layouts: Sequence[str], project_to: Sequence[int] = ()
) -> Advice:
    """Each layout's predicted pass over the data, and its projection to ``project_to``
    workers; the recommendation is the faster within a tenth, the vectors on every worker
    before the shards (nothing more to host).

    Raises:
        ValueError: the probe has no local step, or no parameter-server step for that row.
    """
    if LOCAL not in probe.timings:
        raise ValueError(f"the probe has no {LOCAL!r} timing: {probe.skipped.get(LOCAL, 'not run')}")
    local = probe.timings[LOCAL]
    n, model_bytes = probe.workers, 4.0 * probe.params
    work = Workload(params=probe.params, compute_s=local.step_s, batch=probe.batch_size)
    link = _link(probe)
    history_mb = 2 * run.history * model_bytes / 1e6
    rows, skipped = [], {}
    for name in layouts:
        served = LAYOUTS[name] == "parameter_server"
        if served and SERVED_PROBE not in probe.timings:
            skipped[name] = probe.skipped.get(SERVED_PROBE, "the parameter server's step was not probed")
            continue
        cost = full_batch_pass(
            Cluster(n),
            link,
            work,
            run.batches,
            served=served,
            vector_op_s=run.vector_op_s(served),
            history=run.history,
        )
        # a pass replays the epoch cache: it holds what an epoch of local steps adds beyond them
        pass_s = cost.compute_s + _exchange_s(probe, served, cost.comm_s) + local.epoch_overhead_s
        sent = _sent(probe, served, model_bytes)
        where = (
            f"on the driver's {run.shards} shard{'s' if run.shards > 1 else ''}, "
            f"{history_mb / run.shards:,.1f} MB each"
            if served
            else f"on every worker, {history_mb:,.1f} MB each"
        )
        how = (
            "the push and pull as probed"
            if served
            else "the gradient's sum" + (" as probed" if probe.gradient_sum_s else " round the ring")
        )
        source = (
            f"modelled: {run.batches} local steps + {how} + {lbfgs_vector_ops(run.history)} vector "
            f"operations a pass; {run.history} history pairs {where}"
        )
        settings = {"strategy": LAYOUTS[name]}
        rows.append(Prediction(name, settings, run.total_rows / pass_s, pass_s, sent, source, exact=True))
    if not rows:
        raise ValueError(f"no L-BFGS layout could be predicted: {skipped}")
    rows.sort(key=lambda r: -r.samples_per_s)
    advice = Advice(rows, skipped, run.total_rows, probe, unit="pass", preference=tuple(LAYOUTS))
    advice.note = (
        "both layouts take the same iterates; an iteration is one pass, or more where its line "
        "search evaluates again"
    )
    if project_to and probe.link.bytes_per_s > 0:
        advice.projections = _projections(probe, run, layouts, link, work, project_to)
    return advice


def _link(probe: ProbeResult) -> Link:
    """The probe's link; any link for one worker (nothing crosses it, and it was not measured)."""
    if probe.link.bytes_per_s <= 0:
        return Link(1.0)
    return Link(probe.link.bytes_per_s * 8 / 1e9, probe.link.latency_s)


def _exchange_s(probe: ProbeResult, served: bool, modelled_s: float) -> float:
    """A pass's exchange: the push and pull as the probe timed them (the server's step less
    the local one), or the pass's sums as the probe timed them through the run's own exchange
    (shared memory among one host's workers: the link's all-reduce would miss it), else the
    ring all-reduce the link's figures price."""
    if probe.workers < 2:
        return 0.0
    if served:
        return max(probe.timings[SERVED_PROBE].step_s - probe.timings[LOCAL].step_s, 0.0)
    return probe.gradient_sum_s or modelled_s


def _sent(probe: ProbeResult, served: bool, model_bytes: float) -> float:
    """Bytes a worker sends a pass: the server's measured push, or its ring's share."""
    if served:
        return probe.timings[SERVED_PROBE].bytes_per_step
    return ring_share(probe.workers) * model_bytes


def _projections(
    probe: ProbeResult,
    run: FullBatchRun,
    layouts: Sequence[str],
    link: Link,
    work: Workload,
    to: Sequence[int],
) -> dict[str, dict[int, float]]:
    """Samples/s of each layout's pass at ``to`` workers, the rows spread evenly over them."""
    out: dict[str, dict[int, float]] = {}
    for name in layouts:
        served = LAYOUTS[name] == "parameter_server"
        priced = {}
        for n in to:
            batches = max(math.ceil(run.total_rows / (n * probe.batch_size)), 1)
            cost = full_batch_pass(
                Cluster(n),
                link,
                work,
                batches,
                served=served,
                vector_op_s=run.vector_op_s(served),
                history=run.history,
            )
            priced[n] = run.total_rows / cost.step_s
        out[name] = priced
    return out
