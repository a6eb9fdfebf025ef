"""``sparkdl.run``: your own training function on every worker, with ``ctx``: the
DataFrame's partition as batches of tensors, ``ctx.prepare`` for any models and optimizers
under the strategy one setting chooses, ``ctx.report``, checkpoints a re-run resumes from.

The driver's side: check the settings and the DataFrame's columns (as ``fit`` does), then
run one barrier task per worker (:mod:`sparkdl.spark.own_loop_task`) on the barrier-stage
kit every entry point uses (:mod:`sparkdl.spark.stage`: the cluster checked, the stage's
servers and progress, a shuffle after it so that Spark re-runs it after a lost worker),
with the parameter server where the strategy hosts the model on the driver, and bring
back rank 0's return value and history.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from sparkdl.config import SparkDLConfig
from sparkdl.data.columns import LabelKind
from sparkdl.data.inputs import TransformFn
from sparkdl.errors import ClusterConfigError, ConfigError
from sparkdl.launch.user_code import showing_worker_output
from sparkdl.services.progress.board import announce
from sparkdl.spark.cluster import driver_host
from sparkdl.spark.driver import plan_inputs
from sparkdl.spark.own_loop_task import META, own_loop_partition
from sparkdl.spark.preflight import sample_batch
from sparkdl.spark.ps_host import serve_parameters
from sparkdl.spark.returned_rows import RETURNED_SCHEMA, rank0_value
from sparkdl.spark.shipping import pickled_call
from sparkdl.spark.stage import stage_input, training_site, training_stage
from sparkdl.spark.storage import with_spark_storage_options
from sparkdl.spark.tracking import check_tracking, log_run
from sparkdl.strategies import check_settings, strategy_class
from sparkdl.training.factory import OptimizerFn
from sparkdl.worker.own_loop import LoopSpec
from sparkdl.worker.prepare import check_own_loop_settings


@dataclass
class RunResult:
    """What ``sparkdl.run`` brings back.

    Attributes:
        value: what ``train_fn`` returned on rank 0 (a dict of tensors comes back as tensors,
            loaded ``weights_only``; anything else cloudpickled).
        history: rank 0's ``ctx.report`` records, in order.
        worker_devices: per rank, the device it ran on and its host.
        mlflow_run_id: the MLflow run that logged the settings and ``history`` (with a
            tracking URI set, as for ``TorchEstimator``; None: not logged).
    """

    value: Any
    history: list[dict[str, Any]] = field(default_factory=list)
    worker_devices: list[dict[str, Any]] = field(default_factory=list)
    mlflow_run_id: str | None = None  # the MLflow run that logged it (None: not logged)


def run(
    train_fn: Callable[..., Any],
    *args: Any,
    df: Any = None,
    num_workers: int = 2,
    strategy: str = "allreduce",
    transform_fn: TransformFn | None = None,
    model_fn: Callable[[], nn.Module] | None = None,
    optimizer_fn: OptimizerFn | None = None,
    config: SparkDLConfig | None = None,
    spark: Any = None,
    **settings: Any,
) -> RunResult:
    """Call ``train_fn(ctx, *args)`` on ``num_workers`` workers, each fed its partition of ``df``.

    Args:
        train_fn: your training function; its first argument is the worker's
            :class:`~sparkdl.worker.context.TrainContext`.
        df: the DataFrame to train on (None: no feed; bring your own data).
        num_workers: the workers (one barrier task each).
        strategy: how the prepared models stay in sync: ``"allreduce"``, ``"fsdp"``,
            ``"weight_averaging"`` or ``"parameter_server"`` (``ps_mode`` sync, ssp or async).
        transform_fn: decodes what no built-in decoder reads, as for ``TorchEstimator``.
        model_fn, optimizer_fn: with ``"parameter_server"``, the model the server hosts (the
            one ``train_fn`` prepares) and the optimizer it runs (default: the
            ``[optimizer]`` settings: ``optimizer``, ``lr``, ...).
        config: settings to start from (default: the defaults).
        spark: the session, where there is no ``df`` (default: the active one).
        settings: any other setting by name (``batch_size=64``, ``epochs=3``, ``sync_every=8``,
            ``compression="1bit"``, ``checkpoint_dir=...``, ``feature_cols=[...]``, ...).

    Raises:
        ConfigError: a setting the own loop cannot run with; a function that cannot be pickled.
        SchemaError: the DataFrame's columns do not fit the data settings.
        TrainFunctionError: ``train_fn`` raised (the first rank's error, with its traceback).
    """
    config = (config or SparkDLConfig()).replace(num_workers=num_workers, strategy=strategy, **settings)
    check_own_loop_settings(config)
    config = check_settings(config)
    _check_hosted(config, df, model_fn)
    check_tracking(config)  # a store MLflow refuses fails now, not after the run
    name, payload = pickled_call(train_fn, args, {}, "sparkdl.run")
    if spark is None:
        if df is not None:
            spark = df.sparkSession
        else:
            from pyspark.sql import SparkSession

            spark = SparkSession.active()
    config = with_spark_storage_options(spark, config)
    spec = LoopSpec(config, payload, name)
    if df is not None:
        label = config.data.label_col if config.data.label_col in df.columns else ""
        plan = plan_inputs(df, config.data, _label_kind(df, label), transform_fn, with_label=bool(label))
        if config.runtime.progress:
            announce("reading the first rows (a Spark job)")
        sample = sample_batch(df, plan)
        spec = dataclasses.replace(spec, plan=plan, template=sample.head(2) if sample is not None else None)
    started = time.perf_counter()
    with showing_worker_output():
        result = _run_stage(spark, df, spec, model_fn, optimizer_fn)
    result.mlflow_run_id = log_run(config, result.history, time.perf_counter() - started)
    return result


def _check_hosted(config: SparkDLConfig, df: Any, model_fn: Callable[[], nn.Module] | None) -> None:
    """A strategy whose model the driver hosts needs the model's function, and a DataFrame
    (every step of ``ctx.batches`` pushes and pulls).

    Raises:
        ConfigError: either is missing.
    """
    if not strategy_class(config.training.strategy).hosted_on_driver:
        return
    name = config.training.strategy.value
    if df is None:
        raise ConfigError(
            f"strategy = {name!r} in your own loop pushes and pulls at every step of ctx.batches, "
            "which needs a DataFrame: pass df=..., or use allreduce or weight_averaging"
        )
    if model_fn is None:
        raise ConfigError(
            f"strategy = {name!r} hosts the model on the driver: pass model_fn= (the function that "
            "builds the model train_fn prepares) and optimizer_fn= or the optimizer settings"
        )


def _label_kind(df: Any, label: str) -> LabelKind:
    """Integer labels are class ids (int64); anything else is a real target (float32)."""
    if not label:
        return LabelKind.REAL
    from pyspark.sql.types import IntegralType

    return LabelKind.CLASS_INDEX if isinstance(df.schema[label].dataType, IntegralType) else LabelKind.REAL


def _run_stage(
    spark: Any,
    df: Any,
    spec: LoopSpec,
    model_fn: Callable[[], nn.Module] | None = None,
    optimizer_fn: OptimizerFn | None = None,
) -> RunResult:
    config = spec.config
    n = config.training.num_workers
    site = training_site(spark, config)
    with contextlib.ExitStack() as stack:
        if model_fn is not None and strategy_class(config.training.strategy).hosted_on_driver:
            if site.connect:
                raise ClusterConfigError(
                    f"strategy {config.training.strategy.value!r} hosts its server in the Spark driver "
                    "process, which a Spark Connect client cannot run code in; use 'allreduce' or "
                    "'weight_averaging'"
                )
            server, _, endpoint = serve_parameters(
                config, model_fn, optimizer_fn, driver_host(spark), site.attempt_started
            )
            stack.callback(server.stop)
            spec = dataclasses.replace(spec, ps=endpoint)
        stage = stack.enter_context(training_stage(site, config))
        spec = dataclasses.replace(
            spec, weights=stage.weights, meeting=stage.meeting, progress=stage.progress_endpoint
        )
        if df is not None and spec.plan is not None:
            data = stage_input(df, spec.plan.column_names, n)
        else:
            data = spark.range(0, n, 1, n)
        task = functools.partial(own_loop_partition, spec)
        rows = stage.run(data, task, RETURNED_SCHEMA, f"sparkdl run: {spec.name} on {n} workers")
        value = rank0_value(rows, stage.uploaded())
        metas = {row["rank"]: json.loads(bytes(row["chunk"])) for row in rows if row["kind"] == META}
        return RunResult(
            value,
            metas.get(0, {}).get("history", []),
            [metas[r]["device"] for r in sorted(metas)],
        )
    raise AssertionError("unreachable")  # pragma: no cover
