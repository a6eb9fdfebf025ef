"""Driver side of the strategy advisor: probe the real cluster, predict, recommend.

``advise(df, estimator)`` runs one barrier stage of the estimator's ``num_workers`` tasks
on the first rows of every partition (:mod:`sparkdl.worker.probe` times a few steps of
each candidate strategy there, with the real loop, feed and strategies), hosting one
parameter server per parameter-server candidate in this process for the length of the
stage, then models the candidates it did not train (:mod:`sparkdl.advisor.predict`) for a run
over all of ``df``'s rows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Sequence
from typing import Any

import torch

from sparkdl.advisor.costmodel import ModelShape
from sparkdl.advisor.full_batch import (
    SERVED,
    FullBatchRun,
    chosen_layouts,
    full_batch_candidates,
    layout_settings,
    predict_full_batch,
)
from sparkdl.advisor.predict import (
    LOCAL,
    Advice,
    Candidate,
    Derived,
    LinkEstimate,
    ProbeResult,
    Timing,
    predict,
    probe_set,
)
from sparkdl.config import Hierarchy, OptimizerName
from sparkdl.data.tensors import Batch
from sparkdl.errors import BadDataError, ConfigError, SparkDLError
from sparkdl.services.ps.server import server_threads
from sparkdl.services.ps.sharding import shards_for
from sparkdl.spark.cluster import check_cluster, described, driver_host, executor_hosts, is_connect
from sparkdl.spark.preflight import sample_batch
from sparkdl.spark.probe_task import PROBE_SCHEMA, probe_partition
from sparkdl.spark.ps_host import HostedServer, host_parameter_server
from sparkdl.spark.resources import training_profile
from sparkdl.spark.stage import needs_repartition, translate_failure
from sparkdl.strategies import REGISTRY, check_settings, strategy_class
from sparkdl.training.factory import build_model
from sparkdl.training.full_batch import vector_op_seconds
from sparkdl.worker.assembly import TrainSpec
from sparkdl.worker.probe import ProbeCandidate, ProbeSpec

log = logging.getLogger(__name__)

#: What a probe leaves out of every candidate: no checkpoints, drills, progress bars or
#: early stopping (they would time something else, or write where the run will).
_PROBE_SETTINGS = {
    "on_nan_loss": "skip",  # a candidate diverging on the probe's few rows stops no other
    "checkpoint_dir": "",
    "checkpoint_every": 0,
    "fault_injection": "",
    "progress": False,
    "early_stopping_patience": 0,
    # streaming's fragments send a whole round's bytes over the same steps: probed as whole
    # rounds (the probe's tau 1 leaves no room for fragments, nor for a delay)
    "fragments": 1,
    "fragment_delay": 0,
}


def advise(
    df: Any,
    estimator: Any,
    *,
    steps: int = 64,
    budget_s: float = 0.5,
    passes: int = 2,
    strategies: Sequence[str] | None = None,
    project_to: Sequence[int] = (),
) -> Advice:
    """Probe the cluster with ``estimator``'s model, data and settings; predict the samples/s
    of every strategy, tau and compression for a fit over all of ``df``; recommend one.

    Args:
        df: the DataFrame (or RDD) ``estimator.fit`` would get.
        estimator: a :class:`sparkdl.TorchEstimator`; its ``num_workers``, batch size, model,
            optimizer and loss are what the probe trains.
        steps: batches of its partition each worker trains per candidate epoch (its first
            rows); more steps, steadier figures.
        budget_s: timed seconds per candidate and pass (after a warm-up epoch, one to nine timed).
        passes: how often each candidate is probed, in alternating order (the figures are
            the mean): a shared machine's drifting speed then favours none.
        strategies: only the candidates whose names start with one of these (e.g.
            ``["allreduce", "weight_averaging"]``), with the probed ones they are modelled
            from; default: every one.
        project_to: worker counts to project a few strategies to (:mod:`sparkdl.advisor.costmodel`).

    With ``optimizer = "lbfgs"`` there are no steps to compare: the advice is where its
    vectors live, on every worker or on the parameter server's shards, each row one pass over
    ``df`` (:func:`advise_full_batch`).

    Returns:
        :class:`sparkdl.advisor.predict.Advice`: ``print(advice)`` shows the table and the
        recommendation; ``advice.recommended.settings`` are keyword arguments for the
        estimator.

    Raises:
        ConfigError: ``steps``, ``budget_s`` or ``passes`` out of range, or a name in
            ``strategies`` that no candidate has.
        BadDataError: ``df`` has no rows to train on.
        SparkDLError: the probe stage failed (the worker's error, with its rank).
    """
    if steps < 2 or budget_s <= 0 or passes < 1:
        raise ConfigError(
            f"advise needs steps >= 2, budget_s > 0 and passes >= 1, got steps={steps}, "
            f"budget_s={budget_s}, passes={passes}"
        )
    dataset, spec = estimator.training_spec(df)
    config = spec.config
    if config.optimizer.optimizer is OptimizerName.LBFGS:
        return advise_full_batch(dataset, spec, steps, budget_s, passes, strategies, project_to)
    spread = config.runtime.hierarchy is Hierarchy.NONE and not is_connect(df.sparkSession)
    probed, derived = probe_set(
        config.weight_averaging.sync_every,
        config.parameter_server.staleness,
        config.parameter_server.push_every,
        hosts=len(executor_hosts(df.sparkSession.sparkContext)) if spread else 1,
    )
    if strategies:
        probed, derived = chosen_candidates(probed, derived, strategies)
    total_rows, steps_per_epoch = run_length(dataset, spec)
    result = probe(dataset, spec, probed, steps, budget_s, passes)
    patterns = {name: strategy_class(name).pattern for name in REGISTRY}  # each strategy's own
    advice = predict(result, probed, derived, total_rows, project_to, steps_per_epoch, patterns)
    log.info("strategy advice for %d rows on %d workers: %s", total_rows, result.workers, advice.summary())
    return advice


def advise_full_batch(
    df: Any,
    spec: TrainSpec,
    steps: int,
    budget_s: float,
    passes: int,
    strategies: Sequence[str] | None,
    project_to: Sequence[int],
) -> Advice:
    """``advise`` for ``optimizer = "lbfgs"``: a pass over the data with L-BFGS's vectors on
    every worker (``allreduce``) or on the parameter server's shards, from the probe's local
    step and server step (:mod:`sparkdl.advisor.full_batch`). A layout the estimator's other
    settings refuse (e.g. validation on the server) is listed with fit's own reason.

    Raises:
        ConfigError: ``strategies`` names neither layout (their names listed), or the
            settings refuse both.
    """
    layouts = chosen_layouts(strategies)
    config = spec.config
    refused = {}
    for name in layouts:
        try:
            check_settings(config.replace(**layout_settings(name)))
        except ConfigError as exc:
            refused[name] = str(exc)
    if len(refused) == len(layouts):
        raise ConfigError(f"advise: the estimator's settings refuse every L-BFGS layout: {refused}")
    total_rows, batches = run_length(df, spec)
    probed = [name for name in layouts if name not in refused]
    result = probe(df, spec, full_batch_candidates(probed), steps, budget_s, passes)
    driver_op_s = 0.0  # the shards' algebra, on the coordinator's threads: where they are a layout
    if SERVED in probed:
        with server_threads(config.parameter_server.ps_torch_threads):
            driver_op_s = vector_op_seconds(result.params, config.lbfgs.history_size, torch.device("cpu"))
    run = FullBatchRun(
        total_rows=total_rows,
        batches=batches,
        history=config.lbfgs.history_size,
        shards=shards_for(result.params, config.parameter_server.ps_shards),
        weight_decay=config.optimizer.weight_decay > 0,
        worker_op_s=result.vector_op_s,  # timed on every worker at once, as their algebra runs
        driver_op_s=driver_op_s,
        refused=refused,
    )
    advice = predict_full_batch(result, run, layouts, project_to)
    log.info("L-BFGS advice for %d rows on %d workers: %s", total_rows, result.workers, advice.summary())
    return advice


def chosen_candidates(
    probed: list[Candidate], derived: list[Derived], strategies: Sequence[str]
) -> tuple[list[Candidate], list[Derived]]:
    """The candidates named (by prefix) in ``strategies``, plus the probed ones that the
    chosen modelled rows follow from, and the local step.

    Raises:
        ConfigError: a name that starts no candidate's name (the valid names listed).
    """
    names = [c.name for c in probed if c.name != LOCAL] + [d.candidate.name for d in derived]
    unknown = [w for w in strategies if not any(name.startswith(w) for name in names)]
    if unknown:
        raise ConfigError(
            f"advise(strategies=...) got {unknown}, which start no candidate's name; the names: {names}"
        )
    wanted = tuple(strategies)
    derived = [d for d in derived if d.candidate.name.startswith(wanted)]
    needed = {LOCAL} | {d.parent for d in derived} | {d.other for d in derived}
    return [c for c in probed if c.name in needed or c.name.startswith(wanted)], derived


def run_length(df: Any, spec: TrainSpec) -> tuple[int, int]:
    """The rows a fit of ``df`` trains on (held-out rows excluded) and the steps a worker
    takes per epoch: over balanced partitions when fit repartitions, else over the largest.

    Raises:
        BadDataError: there is no row to train on.
    """
    from pyspark.sql import functions as F

    config, n = spec.config, spec.config.training.num_workers
    rows_per_step = config.training.batch_size * config.training.accumulate_steps
    data = df.where(~F.col(spec.plan.validation_col)) if spec.plan.validation_col else df
    if needs_repartition(df.select(*spec.plan.column_names), n, df.sparkSession):
        total = data.count()
        largest = -(-total // n)
    else:  # fit keeps these partitions: the largest sets the epoch
        counts = [row[1] for row in data.groupBy(F.spark_partition_id()).count().collect()]
        total, largest = sum(counts), max(counts, default=0)
    if total == 0:
        raise BadDataError(
            "the DataFrame given to advise has no rows to train on; check the filters and joins upstream",
            bad_rows=0,
        )
    return total, max(-(-largest // rows_per_step), 1)


def probe(
    df: Any, spec: TrainSpec, candidates: Sequence[Candidate], steps: int, budget_s: float, passes: int = 2
) -> ProbeResult:
    """Run the probe stage: every candidate trained for a few timed epochs on the first
    ``steps`` batches of each partition. A candidate the settings refuse (e.g. fsdp with
    fp16) or this session cannot host (the parameter server over Spark Connect) is skipped
    with the reason."""
    config = spec.config.replace(**_PROBE_SETTINGS)
    n = config.training.num_workers
    spark = df.sparkSession
    profile = None if is_connect(spark) else training_profile(spark, config.runtime.use_gpu)
    check_cluster(
        spark, n, config.runtime.executor_wait_timeout_s, config.runtime.collective_timeout_s, profile
    )
    template = sample_batch(df, spec.plan)
    spec = dataclasses.replace(
        spec, config=config, template=template.head(2) if template is not None else None
    )
    model = build_model(spec.model_fn)  # on the driver once: the strategies' model rules, its shape
    shape = _shape(model, template, spec)
    chosen, skipped, hosted = _candidates(spark, spec, candidates, model)
    del model
    try:
        # only the rows probed, spread evenly: no pass over (or shuffle of) the whole data
        rows = steps * config.training.batch_size * config.training.accumulate_steps
        data = df.select(*spec.plan.column_names).limit(n * rows).repartition(n)
        task = ProbeSpec(spec, tuple(chosen), steps, budget_s, passes)
        stage = data.mapInArrow(
            functools.partial(probe_partition, task), PROBE_SCHEMA, barrier=True, profile=profile
        )
        try:
            with described(spark, f"sparkdl advise: {len(chosen)} candidates on {n} workers"):
                results = stage.collect()
        except Exception as exc:
            raise translate_failure(exc) from exc
    finally:
        for server in hosted:
            server.stop()
    figures = next(json.loads(r["probe"]) for r in results if json.loads(r["probe"])["rank"] == 0)
    link = figures["link"]
    return ProbeResult(
        workers=n,
        batch_size=config.training.batch_size * config.training.accumulate_steps,
        params=int(figures["params"]),
        timings={name: Timing(**t) for name, t in figures["timings"].items()},
        skipped=skipped,
        link=LinkEstimate.from_all_reduce(n, link["tiny_s"], link["model_s"], 4.0 * link["floats"]),
        shape=shape,
        microbatches=config.pipeline.microbatches,
        group=config.tensor.tp_size,
        accumulate=config.training.accumulate_steps,
        gradient_sum_s=float(figures.get("gradient_sum_s", 0.0)),
        vector_op_s=float(figures.get("vector_op_s", 0.0)),
    )


def _shape(model: torch.nn.Module, batch: Batch | None, spec: TrainSpec) -> ModelShape:
    """What ``model`` sends under model parallelism and sufficient factors, for the projections;
    empty where the driver cannot run it on ``batch`` (e.g. a layer only the workers' GPUs run)."""
    from sparkdl.advisor.shape import model_shape  # the model-parallel strategies' modules: here only

    if batch is None:
        return ModelShape()
    try:
        shape = model_shape(model, batch, spec.config, spec.config.training.num_workers, spec.plan.keyword)
    except Exception as exc:  # the projections leave those rows out; the probe itself reports errors
        log.warning("the model's shape for the projections: %s: %s", type(exc).__name__, exc)
        return ModelShape()
    if spec.parallelize_fn is not None:  # your split, not the built-in plan the shape read
        shape = dataclasses.replace(
            shape, split_bytes=0.0, split_collectives=0, split_params=0, split_compute=0.0
        )
    return shape


def _candidates(
    spark: Any, spec: TrainSpec, candidates: Sequence[Candidate], model: torch.nn.Module
) -> tuple[list[ProbeCandidate], dict[str, str], list[HostedServer]]:
    """Each candidate's full settings (and parameter server), or why it is skipped (``model``:
    the user's, for the strategies' model rules)."""
    chosen: list[ProbeCandidate] = []
    skipped: dict[str, str] = {}
    hosted: list[HostedServer] = []
    try:
        for candidate in candidates:
            try:
                config = check_settings(spec.config.replace(**candidate.settings))
                kind = strategy_class(config.training.strategy)
                if spec.parallelize_fn is None or not kind.takes_parallelize_fn:
                    kind.check_model(model, config)
            except SparkDLError as exc:
                skipped[candidate.name] = str(exc)
                continue
            ps = None
            if kind.hosted_on_driver:
                if is_connect(spark):
                    skipped[candidate.name] = (
                        "the parameter server runs in the driver process, not a Connect client"
                    )
                    continue
                server = host_parameter_server(dataclasses.replace(spec, config=config), driver_host(spark))
                hosted.append(server)
                ps = server.spec.ps
            chosen.append(ProbeCandidate(candidate.name, config, ps))
    except BaseException:
        for server in hosted:
            server.stop()
        raise
    return chosen, skipped, hosted
