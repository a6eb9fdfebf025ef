"""Driver side of ``fit``: validate, launch the barrier stage, gather the result.

The training stage is ``mapInArrow(train_partition, barrier=True)`` followed by a
shuffle (``repartition(1)``). The shuffle makes the barrier stage a
ShuffleMapStage, which Spark re-runs as a whole when a task fails, instead of
aborting the job as it does for a failed barrier ResultStage.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import torch

from sparkdl.config import SparkDLConfig, Strategy
from sparkdl.data.columns import ColumnPlan, LabelKind, plan_from_arrow_schema
from sparkdl.errors import ErrorRecord, SchemaError, SparkDLError, StageStalledError, TrainingFailedError
from sparkdl.progress.board import ProgressBoard
from sparkdl.progress.channel import ProgressServer
from sparkdl.runtime.cluster import check_cluster, is_connect
from sparkdl.runtime.environment import check_executor_environment
from sparkdl.runtime.preflight import check_model
from sparkdl.runtime.ps_host import start_parameter_server
from sparkdl.runtime.resources import training_profile
from sparkdl.runtime.task import RESULT_SCHEMA, TrainSpec, train_partition
from sparkdl.runtime.watch import MARGIN_S, collect_watched
from sparkdl.training.factory import state_from_bytes

log = logging.getLogger(__name__)


@dataclass
class FitResult:
    """What ``fit`` brings back to the driver: one copy of the weights, and figures."""

    state_dict: dict[str, torch.Tensor]
    history: list[dict[str, Any]]
    output_shape: tuple[int, ...]
    input_shape: tuple[int, ...]
    worker_devices: list[dict[str, Any]]  # per rank: the device it trained on, the GPUs Spark gave it
    worker_rows: list[int]
    bad_rows_skipped: int = 0


def plan_columns(
    df: Any, feature_cols: tuple[str, ...], label_col: str | None, label_kind: LabelKind
) -> ColumnPlan:
    """Check the DataFrame's schema on the driver, before any task starts."""
    from pyspark.sql.pandas.types import to_arrow_schema

    names = [*feature_cols, *([label_col] if label_col else [])]
    missing = [c for c in names if c not in df.columns]
    if missing:
        raise SchemaError(
            f"column(s) {missing} not found; the DataFrame has {df.columns}. "
            "Set feature_cols/label_col to existing columns"
        )
    try:
        arrow_schema = to_arrow_schema(df.select(*names).schema)
    except Exception as exc:
        raise SchemaError(f"columns {names} cannot be sent to executors as Arrow: {exc}") from exc
    return plan_from_arrow_schema(arrow_schema, feature_cols, label_col, label_kind)


def run_training(df: Any, spec: TrainSpec) -> FitResult:
    """Train on ``df`` with one barrier task per worker; return rank 0's weights and history."""
    config = spec.config
    n = config.training.num_workers
    spark = df.sparkSession
    profile = None if is_connect(spark) else training_profile(spark, config.runtime.use_gpu)
    check_cluster(
        spark, n, config.runtime.executor_wait_timeout_s, config.runtime.collective_timeout_s, profile
    )
    if config.runtime.preflight:  # mistakes that fail on every attempt fail here, once, in seconds
        check_executor_environment(spark, max(config.runtime.executor_wait_timeout_s, 60.0))
        check_model(df, spec)
    hosted = progress = None
    if config.training.strategy is Strategy.PARAMETER_SERVER:
        hosted = start_parameter_server(spark, spec)
        spec = hosted.spec
    try:
        progress = start_progress_channel(spark, config)
        if progress is not None:
            spec = dataclasses.replace(spec, progress=progress.endpoint())
        data = df.select(*spec.plan.column_names)
        if is_connect(spark) or data.rdd.getNumPartitions() != n:
            data = data.repartition(n)
        stage = data.mapInArrow(
            functools.partial(train_partition, spec), RESULT_SCHEMA, barrier=True, profile=profile
        )
        _describe_job(spark, f"sparkdl fit: {n} workers, {config.training.epochs} epochs")
        runtime = config.runtime
        bound_s = runtime.collective_timeout_s + runtime.teardown_timeout_s + MARGIN_S
        silence = progress.silence if progress is not None else None
        try:
            rows = collect_watched(spark, stage.repartition(1), silence, bound_s)
        except StageStalledError:
            raise
        except Exception as exc:
            raise _translate(exc) from exc
        result = _fit_result(rows, n)
        if hosted is not None:
            result.state_dict.update(hosted.parameter_state())
        return result
    finally:
        if progress is not None:
            progress.stop()
        if hosted is not None:
            hosted.stop()


def start_progress_channel(spark: Any, config: SparkDLConfig) -> ProgressServer | None:
    """Listen for the workers' progress and log records on the driver's address.

    A Spark Connect client is not the driver, and executors cannot reach it, so it
    gets no live progress (the result's history is complete all the same).
    """
    if is_connect(spark):
        log.info("Spark Connect session: no live progress; fit's history holds every figure")
        return None
    board = ProgressBoard(config.training.num_workers, config.training.epochs, show=config.runtime.progress)
    host = spark.conf.get("spark.driver.host", "127.0.0.1")
    return ProgressServer(board, host, secrets.token_bytes(32), config.runtime.progress_interval_s)


def _fit_result(rows: list[Any], n: int) -> FitResult:
    _raise_agreed_error(rows)
    by_rank = {row["rank"]: row for row in rows}
    if sorted(by_rank) != list(range(n)):
        raise TrainingFailedError(f"expected results from ranks 0..{n - 1}, got {sorted(by_rank)}")
    lead = by_rank[0]
    state = state_from_bytes(lead["state"])
    history = json.loads(lead["history"])
    per_worker = {r: json.loads(by_rank[r]["history"]) for r in range(n)}
    for i, record in enumerate(history):
        record["worker_samples"] = [per_worker[r][i]["local_samples"] for r in range(n)]
        record["worker_seconds"] = [per_worker[r][i]["seconds"] for r in range(n)]
        record["worker_nan_skips"] = [per_worker[r][i]["nan_skips"] for r in range(n)]
        record["nan_skips"] = max(record["worker_nan_skips"])
        del record["local_samples"]
    return FitResult(
        state_dict=state,
        history=history,
        output_shape=tuple(json.loads(lead["output_shape"])),
        input_shape=tuple(json.loads(lead["input_shape"])),
        worker_devices=[json.loads(by_rank[r]["device"]) for r in range(n)],
        worker_rows=[int(by_rank[r]["rows"]) for r in range(n)],
        bad_rows_skipped=sum(int(by_rank[r]["bad_rows"]) for r in range(n)),
    )


def _raise_agreed_error(rows: list[Any]) -> None:
    """Raise the error that made every rank stop together (the rejecting rank's, not its peers')."""
    records = [ErrorRecord.from_json(row["error"]) for row in rows if row["error"]]
    if records:
        records.sort(key=lambda r: r.error_type == "PeerStopped")
        raise located(records[0].to_error())


def _translate(exc: Exception) -> SparkDLError:
    """The error a worker raised, rebuilt from the record its failed task carried; the
    Spark failure itself (first line) when no worker's record is in it."""
    records = ErrorRecord.find_embedded(str(exc))
    if records:
        return located(records[-1].to_error())
    text = str(exc).strip()
    detail = text.splitlines()[0] if text else type(exc).__name__
    return TrainingFailedError(f"the training stage failed: {detail[:2000]}")


def located(error: SparkDLError) -> SparkDLError:
    """The same error, its message prefixed with the rank it happened on (when known)."""
    if error.rank is not None and not error.message.startswith(f"rank {error.rank}"):
        error.message = f"rank {error.rank}: {error.message}"
        error.args = (error.message,)
    return error


def _describe_job(spark: Any, text: str) -> None:
    if not is_connect(spark):
        spark.sparkContext.setJobDescription(text)
