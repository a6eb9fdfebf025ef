"""Driver side of the strategy advisor: probe the real cluster, predict, recommend.

``advise(df, estimator)`` runs one barrier stage of the estimator's ``num_workers`` tasks
on the first rows of every partition (:mod:`sparkdl.runtime.probe` times a few steps of
each candidate strategy there, with the real loop, feed and strategies), hosting one
parameter server per parameter-server candidate in this process for the length of the
stage, then models the candidates it did not train (:mod:`sparkdl.advice`) for a run
over all of ``df``'s rows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Sequence
from typing import Any

from sparkdl.advice import Advice, Candidate, LinkEstimate, ProbeResult, Timing, predict, probe_set
from sparkdl.config import SparkDLConfig, Strategy
from sparkdl.errors import ConfigError, SparkDLError
from sparkdl.runtime.cluster import check_cluster, driver_host, is_connect
from sparkdl.runtime.driver import needs_repartition, translate_failure
from sparkdl.runtime.preflight import sample_batch
from sparkdl.runtime.probe import ProbeCandidate, ProbeSpec
from sparkdl.runtime.ps_host import HostedServer, host_parameter_server
from sparkdl.runtime.resources import training_profile
from sparkdl.runtime.task import PROBE_SCHEMA, probe_partition
from sparkdl.runtime.worker import TrainSpec

log = logging.getLogger(__name__)

#: What a probe leaves out of every candidate: no checkpoints, drills, progress bars or
#: early stopping (they would time something else, or write where the run will).
_PROBE_SETTINGS = {
    "checkpoint_dir": "",
    "checkpoint_every": 0,
    "fault_injection": "",
    "progress": False,
    "early_stopping_patience": 0,
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
        budget_s: timed seconds per candidate and pass (at least two timed epochs, at most nine).
        passes: how often each candidate is probed, in alternating order (the figures are
            the mean): a shared machine's drifting speed then favours none.
        strategies: only the candidates whose names start with one of these (e.g.
            ``["allreduce", "weight_averaging"]``); default: every one.
        project_to: worker counts to project a few strategies to (:mod:`sparkdl.costmodel`).

    Returns:
        :class:`sparkdl.advice.Advice`: ``print(advice)`` shows the table and the
        recommendation; ``advice.recommended.settings`` are keyword arguments for the
        estimator.

    Raises:
        ConfigError: ``steps`` or ``budget_s`` out of range.
        SparkDLError: the probe stage failed (the worker's error, with its rank).
    """
    if steps < 2 or budget_s <= 0 or passes < 1:
        raise ConfigError(
            f"advise needs steps >= 2, budget_s > 0 and passes >= 1, got steps={steps}, "
            f"budget_s={budget_s}, passes={passes}"
        )
    dataset, spec = estimator.training_spec(df)
    config = spec.config
    probed, derived = probe_set(
        config.weight_averaging.sync_every,
        config.parameter_server.staleness,
        config.parameter_server.push_every,
    )
    if strategies:
        wanted = tuple(strategies)
        probed = [c for c in probed if c.name == "local" or c.name.startswith(wanted)]
        derived = [d for d in derived if d.candidate.name.startswith(wanted)]
    total_rows = dataset.count()
    result = probe(dataset, spec, probed, steps, budget_s, passes)
    advice = predict(result, probed, derived, total_rows, project_to)
    log.info("strategy advice for %d rows on %d workers: %s", total_rows, result.workers, advice.summary())
    return advice


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
    chosen, skipped, hosted = _candidates(spark, spec, candidates)
    try:
        data = df.select(*spec.plan.column_names)
        if needs_repartition(data, n, spark):
            data = data.repartition(n)
        task = ProbeSpec(spec, tuple(chosen), steps, budget_s, passes)
        stage = data.mapInArrow(
            functools.partial(probe_partition, task), PROBE_SCHEMA, barrier=True, profile=profile
        )
        if not is_connect(spark):
            spark.sparkContext.setJobDescription(f"sparkdl advise: {len(chosen)} candidates on {n} workers")
        try:
            rows = stage.collect()
        except Exception as exc:
            raise translate_failure(exc) from exc
    finally:
        for server in hosted:
            server.stop()
    figures = next(json.loads(row["probe"]) for row in rows if json.loads(row["probe"])["rank"] == 0)
    link = figures["link"]
    return ProbeResult(
        workers=n,
        batch_size=config.training.batch_size * config.training.accumulate_steps,
        params=int(figures["params"]),
        timings={name: Timing(**t) for name, t in figures["timings"].items()},
        skipped=skipped,
        link=LinkEstimate.from_all_reduce(n, link["tiny_s"], link["model_s"], 4.0 * link["floats"]),
    )


def _candidates(
    spark: Any, spec: TrainSpec, candidates: Sequence[Candidate]
) -> tuple[list[ProbeCandidate], dict[str, str], list[HostedServer]]:
    """Each candidate's full settings (and parameter server), or why it is skipped."""
    chosen: list[ProbeCandidate] = []
    skipped: dict[str, str] = {}
    hosted: list[HostedServer] = []
    try:
        for candidate in candidates:
            try:
                config: SparkDLConfig = spec.config.replace(**candidate.settings)
            except SparkDLError as exc:
                skipped[candidate.name] = str(exc)
                continue
            ps = None
            if config.training.strategy is Strategy.PARAMETER_SERVER:
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
