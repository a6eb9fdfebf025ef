"""The driver's side of the asynchronous parameter server in ordinary tasks
(``parameter_server.ps_barrier = false``): Downpour as its authors meant it.

The server is hosted on the driver as for barrier workers; the workers are the tasks of one
plain ``mapInArrow`` stage (not ``barrier=True``), one per partition, each on its own
(:mod:`sparkdl.spark.independent_task`). Nothing is agreed between workers: the rank is the
partition id, there is no meeting point, and each ends its epochs alone. A task that fails
is retried by Spark alone (``spark.task.maxFailures``; in local mode ``local[N, F]``) and
resumes from the server's current weights, skipping the rows its predecessors' pushes
covered; a stale attempt's pushes are refused by the server.

The stage is watched: a partition whose task holds a connection to the server and has not
pushed for longer than the bound (``ps_timeout_s`` plus the teardown's and a margin)
cancels it (:class:`~sparkdl.errors.StageStalledError`); between attempts Spark's own
scheduling decides. The figures of the run join the history's last record: each
partition's rows in the weights, its longest gap between two pushes, and every takeover
(which partition's task was retried, when, and the rows it skipped).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from sparkdl.config import SparkDLConfig
from sparkdl.errors import ConfigError, StageStalledError
from sparkdl.services.ps.task_snapshots import TaskSnapshots
from sparkdl.spark.attempts import running_tasks, task_gate
from sparkdl.spark.cluster import described, own_local_properties
from sparkdl.spark.fit_task import RESULT_SCHEMA
from sparkdl.spark.independent_task import train_alone
from sparkdl.spark.ps_host import start_parameter_server
from sparkdl.spark.stage import Site, stage_input, translate_failure
from sparkdl.spark.watch import MARGIN_S, collect_watched
from sparkdl.worker.assembly import TrainSpec

log = logging.getLogger(__name__)


@dataclass
class IndependentRun:
    """What the stage of independent tasks brought back.

    Attributes:
        rows: each partition's result row.
        weights: the server's trained weights by state-dict key.
        figures: the run's figures for the history (rows applied, push gaps, takeovers).
    """

    rows: list[Any]
    weights: dict[str, torch.Tensor]
    figures: dict[str, Any]


def run_independent(df: Any, spec: TrainSpec, site: Site) -> IndependentRun:
    """Train ``spec`` on ``df`` with one ordinary task per partition against the driver's
    server.

    Raises:
        ConfigError: validation rows given (each task would validate its own weights), or
            a Spark Connect session (no driver process of ours to host the server).
        StageStalledError: a partition connected to the server went silent past the bound.
        SparkDLError: a task failed on every attempt: its error, rebuilt from its record.
    """
    config = spec.config
    n = config.training.num_workers
    if spec.plan.validation_col:
        raise ConfigError(
            "parameter_server.ps_barrier = false with a validation DataFrame: each task would validate "
            "its own copy of the weights at its own epoch end; validate the returned model with "
            "transform, or set ps_barrier = true"
        )
    if site.connect:
        raise ConfigError(
            "parameter_server.ps_barrier = false needs the driver process to host the server and to "
            "watch the stage, which a Spark Connect client cannot; use a classic session"
        )
    # a task's HELLO is believed when Spark's status store lists that task for its partition
    gate = task_gate(site.spark.sparkContext, site.group) if site.group else None
    hosted = start_parameter_server(site.spark, spec, None, gate)
    snapshots, resumed = None, None
    try:
        if config.reliability.checkpoint_dir:  # the driver keeps the server's state there
            kept = _snapshots(hosted.server.stores[0], config)
            resumed = kept.restore()
            kept.watch()
            snapshots = kept  # saved once more at the end: not a fresh store a failed restore left
        # the tasks checkpoint nothing: a retry resumes from the server and its partition's rows
        tasks_config = config.replace(checkpoint_dir="", checkpoint_every=0)
        task_spec = dataclasses.replace(
            hosted.spec, config=tasks_config, weights=None, meeting=None, progress=None
        )
        data = stage_input(df, spec.plan.column_names, n)
        stage = data.mapInArrow(functools.partial(train_alone, task_spec), RESULT_SCHEMA)
        runtime = config.runtime
        bound_s = config.parameter_server.ps_timeout_s + runtime.teardown_timeout_s + MARGIN_S
        description = (
            f"sparkdl fit: {n} independent tasks ({config.parameter_server.ps_mode.value} parameter server), "
            f"{config.training.epochs} epochs"
        )
        with own_local_properties(site.spark), described(site.spark, description):
            try:
                silence = functools.partial(_running_silence, site, hosted.server)
                rows = collect_watched(site.spark, stage, silence, bound_s, site.group)
            except StageStalledError:
                raise
            except Exception as exc:
                raise translate_failure(exc) from exc
        figures = run_figures(hosted.server.task_ledger())
        if resumed is not None:
            figures.update(resumed_from_version=resumed["version"], resumed_rows=resumed["rows_applied"])
        return IndependentRun(rows, hosted.parameter_state(), figures)
    finally:
        try:
            if snapshots is not None:  # failed or not: what the server holds now
                snapshots.close()
        finally:
            hosted.stop()


def _snapshots(store: Any, config: SparkDLConfig) -> TaskSnapshots:
    """The driver's snapshots of ``store`` in ``checkpoint_dir``: one about every
    ``checkpoint_every`` steps of each worker (each pushes every ``push_interval`` steps, an
    update each), else only when the fit ends."""
    reliability, pushes = config.reliability, config.parameter_server.push_interval
    every = reliability.checkpoint_every * config.training.num_workers // pushes
    return TaskSnapshots(store, reliability.checkpoint_dir, reliability.storage_options, max(every, 0))


def _running_silence(site: Site, server: Any) -> dict[int, float]:
    """The silence of each partition whose current task Spark still runs (the stall watch's
    view): a task Spark has given up on (its executor lost, its connection half-open until
    TCP keepalive ends it) is Spark's to retry, not a stall to cancel the fit for. Where the
    status store cannot be read, every silent partition counts."""
    silence = server.task_silence()
    if not silence:
        return silence
    try:
        running = running_tasks(site.spark.sparkContext, site.group)
    except Exception as exc:  # py4j: the JVM busy or going away
        log.warning("cannot read the running tasks from Spark's status store: %s", exc)
        return silence
    watched = {}
    for partition, seconds in silence.items():
        task = server.current_task(partition)
        if task in running:
            watched[partition] = seconds
        else:  # its connection may be half-open: under ssp it must not hold the others back
            server.task_not_running(partition, task)
    return watched


def run_figures(ledger: dict[str, Any]) -> dict[str, Any]:
    """The history's figures of a run of independent tasks, from the server's ledger: each
    partition's rows in the weights, its longest gap between two pushes (seconds) and
    pushes counted, and the takeovers of retried tasks."""
    gaps = []
    for times in ledger["push_times"]:
        gaps.append(round(max((b - a for a, b in itertools.pairwise(times)), default=0.0), 4))
    return {
        "partition_rows_applied": ledger["rows_applied"],
        "partition_push_gap_max_s": gaps,
        "partition_pushes": [len(times) for times in ledger["push_times"]],
        "task_retries": ledger["takeovers"],
    }
