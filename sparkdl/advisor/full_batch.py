"""The advisor's arithmetic for full-batch L-BFGS (``optimizer = "lbfgs"``): where to keep
its vectors, on every worker (strategy ``allreduce``) or on the parameter server's shards
(``parameter_server``), and what a pass over the data costs in each.

Pure (no Spark, no torch). Both layouts take the same iterates (torch.optim.LBFGS's), so
the choice is time and memory. The probe times the step-wise stand-ins of a pass's parts
on the real cluster: the local step (a batch's forward and backward), and the synchronous
parameter server's step (the same plus a push and a pull of the model); and, on every
worker at once, a pass's sums through the run's own exchange and a vector operation of the
algebra. A pass is then (:func:`full_batch_pass`):

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparkdl.advisor.costmodel import Cluster, Link, StepCost, Workload, ring_share, step_cost
from sparkdl.advisor.predict import LOCAL, Advice, Candidate, Prediction, ProbeResult
from sparkdl.comm.traffic import Pattern
from sparkdl.errors import ConfigError

#: The probed candidate whose step is a local step plus a push and a pull of the model.
SERVED_PROBE = "parameter_server sync"
#: The two layouts, by the row names the advice gives them, and what ``fit`` needs set for
#: each: its strategy, and on the server the synchronous mode with every worker's pass in fp32.
LAYOUTS: dict[str, dict[str, Any]] = {
    "lbfgs allreduce": {"strategy": "allreduce"},
    "lbfgs parameter_server": {
        "strategy": "parameter_server",
        "ps_mode": "sync",
        "backup_workers": 0,
        "ps_pull_precision": "fp32",
    },
}
#: The layout with the vectors on the server's shards.
SERVED = "lbfgs parameter_server"
#: What the probe trains in place of L-BFGS (it times steps): plain SGD with a step too small
#: to leave finite numbers, on the same model, rows and batch size.
STAND_IN = {"optimizer": "sgd", "lr": 1e-6, "momentum": 0.0, "weight_decay": 0.0}


def lbfgs_vector_ops(history: int, *, served: bool, weight_decay: bool) -> int:
    """The model-sized vector operations (dots, axpys, copies, scalings) of one L-BFGS
    iteration of one pass with ``history`` correction pairs: the iteration's algebra, 4 a
    pair in the two-loop recursion and 16 for the new pair, the direction and the step
    (:mod:`sparkdl.training.lbfgs`); and the pass's own on the vectors' holder
    (:mod:`sparkdl.training.full_batch`, :mod:`sparkdl.services.ps.full_batch`): on a
    worker the gradient joined and scaled, checked finite and the point written back (5),
    on the shards the point made and checked (3), each with 3 more for ``weight_decay``'s
    term. An iteration whose line search evaluates again repeats the pass's part only."""
    own = (3 if served else 5) + (3 if weight_decay else 0)
    return 4 * history + 16 + own


def full_batch_pass(
    cluster: Cluster,
    link: Link,
    workload: Workload,
    batches: int,
    *,
    served: bool,
    vector_op_s: float = 0.0,
    history: int = 10,
    weight_decay: bool = False,
) -> StepCost:
    """One pass of full-batch L-BFGS: each worker's ``batches`` batches of ``workload``'s
    compute, then the gradient summed after the pass, round a ring (``served`` False: the
    vectors on every worker) or pushed to and pulled from a server (``served``: on its
    shards), and one iteration's :func:`lbfgs_vector_ops` at ``vector_op_s`` each. The
    returned step is the pass; its samples/s count every worker's rows of the pass."""
    if batches < 1:
        raise ValueError(f"a pass reads at least one batch a worker, got batches={batches}")
    algebra_s = lbfgs_vector_ops(history, served=served, weight_decay=weight_decay) * vector_op_s
    whole = Workload(
        params=workload.params,
        compute_s=batches * workload.compute_s + algebra_s,
        batch=batches * workload.batch,
    )
    return step_cost(Pattern.STAR if served else Pattern.RING_PERIODIC, cluster, link, whole)


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
        for name, settings in LAYOUTS.items()
        if any(w and (name.startswith(w) or settings["strategy"].startswith(w)) for w in strategies)
    ]
    if not chosen:
        raise ConfigError(
            f"advise(strategies=...) got {list(strategies)}; with optimizer = 'lbfgs' the layouts are "
            f"{list(LAYOUTS)} (or their strategies, 'allreduce' and 'parameter_server')"
        )
    return chosen


def layout_settings(name: str) -> dict[str, Any]:
    """What ``fit`` needs set for the layout ``name`` (a row of :data:`LAYOUTS`)."""
    return dict(LAYOUTS[name])


def full_batch_candidates(layouts: Sequence[str]) -> list[Candidate]:
    """The probe's candidates for the ``layouts`` (row names of :data:`LAYOUTS`): the local
    step always, and the synchronous parameter server where the shards are a layout."""
    stand_in = {"compression": "none", "sufficient_factors": "off", **STAND_IN}
    local = Candidate(LOCAL, {**stand_in, "strategy": "weight_averaging", "sync_every": 1 << 30})
    served = Candidate(SERVED_PROBE, {**stand_in, **LAYOUTS[SERVED]})
    return [local, served] if SERVED in layouts else [local]


@dataclass(frozen=True)
class FullBatchRun:
    """The L-BFGS run to predict: ``total_rows`` over the workers, ``batches`` a worker per
    pass (its largest partition's), ``history`` pairs, ``shards`` of the parameter server,
    whether the objective has a ``weight_decay`` term, and a model-sized vector operation's
    seconds on the workers (timed on all at once) and on the driver (where the shards'
    algebra runs; 0 where the shards are no layout). ``refused``: layouts the estimator's
    settings refuse, and why."""

    total_rows: int
    batches: int
    history: int
    shards: int
    weight_decay: bool
    worker_op_s: float
    driver_op_s: float
    refused: Mapping[str, str] = field(default_factory=dict)


def predict_full_batch(
    probe: ProbeResult, run: FullBatchRun, layouts: Sequence[str], project_to: Sequence[int] = ()
) -> Advice:
    """Each layout's predicted pass over the data, and its projection to ``project_to``
    workers; the recommendation is the faster within a tenth, the vectors on every worker
    before the shards (nothing more to host).

    Raises:
        ValueError: the probe has no local step, or no layout could be predicted.
    """
    if LOCAL not in probe.timings:
        raise ValueError(f"the probe has no {LOCAL!r} timing: {probe.skipped.get(LOCAL, 'not run')}")
    rows, skipped = [], {}
    for name in layouts:
        if name in run.refused:
            skipped[name] = run.refused[name]
        elif name == SERVED and SERVED_PROBE not in probe.timings:
            skipped[name] = probe.skipped.get(SERVED_PROBE, "the parameter server's step was not probed")
        else:
            rows.append(_row(probe, run, name))
    if not rows:
        raise ValueError(f"no L-BFGS layout could be predicted: {skipped}")
    rows.sort(key=lambda r: -r.samples_per_s)
    advice = Advice(rows, skipped, run.total_rows, probe, unit="pass", preference=tuple(LAYOUTS))
    advice.note = (
        "both layouts take the same iterates; an iteration is one pass, or more where its line "
        "search evaluates again"
    )
    if project_to and probe.link.bytes_per_s > 0:
        predicted = [row.name for row in rows]
        advice.projections = {name: _projected(probe, run, name, project_to) for name in predicted}
    return advice


def _row(probe: ProbeResult, run: FullBatchRun, name: str) -> Prediction:
    """The layout ``name``'s pass on the probed cluster: as :func:`_pass` prices it, with the
    exchange the probe timed in place of the link's price."""
    served = name == SERVED
    cost = _pass(probe, run, served, probe.workers, run.batches)
    pass_s = cost.compute_s + _exchange_s(probe, served, cost.comm_s) + probe.timings[LOCAL].epoch_overhead_s
    model_bytes = 4.0 * probe.params
    history_mb = 2 * run.history * model_bytes / 1e6
    shards = f"{run.shards} shard{'s' if run.shards > 1 else ''}"
    where = (
        f"on the driver's {shards}, {history_mb / run.shards:,.1f} MB each ({history_mb:,.1f} MB there)"
        if served
        else f"on every worker, {history_mb:,.1f} MB each"
    )
    how = (
        "the push and pull as probed"
        if served
        else "the gradient's sum" + (" as probed" if probe.gradient_sum_s else " round the ring")
    )
    ops = lbfgs_vector_ops(run.history, served=served, weight_decay=run.weight_decay)
    source = (
        f"modelled: {run.batches} local steps + {how} + {ops} vector operations a pass; "
        f"{run.history} history pairs {where}"
    )
    sent = probe.timings[SERVED_PROBE].bytes_per_step if served else ring_share(probe.workers) * model_bytes
    return Prediction(name, layout_settings(name), run.total_rows / pass_s, pass_s, sent, source, exact=True)


def _pass(probe: ProbeResult, run: FullBatchRun, served: bool, workers: int, batches: int) -> StepCost:
    """A pass of ``batches`` local steps on ``workers``, its exchange priced from the link."""
    link = Link(1.0)  # one worker: nothing crosses a link, and none was measured
    if probe.link.bytes_per_s > 0:
        link = Link(probe.link.bytes_per_s * 8 / 1e9, probe.link.latency_s)
    return full_batch_pass(
        Cluster(workers),
        link,
        Workload(params=probe.params, compute_s=probe.timings[LOCAL].step_s, batch=probe.batch_size),
        batches,
        served=served,
        vector_op_s=run.driver_op_s if served else run.worker_op_s,
        history=run.history,
        weight_decay=run.weight_decay,
    )


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


def _projected(probe: ProbeResult, run: FullBatchRun, name: str, to: Sequence[int]) -> dict[int, float]:
    """Samples/s of the layout ``name``'s pass at ``to`` workers, the rows spread evenly over
    them: the cost model's pass (its exchange from the link, as every projection's: one that
    crosses a network, where the probe's may have stayed in one host's shared memory) plus
    the local epoch's overhead."""
    served = name == SERVED
    priced = {}
    for n in to:
        batches = max(math.ceil(run.total_rows / (n * probe.batch_size)), 1)
        pass_s = _pass(probe, run, served, n, batches).step_s + probe.timings[LOCAL].epoch_overhead_s
        priced[n] = run.total_rows / pass_s
    return priced
