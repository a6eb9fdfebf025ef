"""Driver side of ``fit``: plan the inputs, check the settings, the model and the cluster
before any worker starts, run the training stage (on the barrier-stage kit,
:mod:`sparkdl.spark.stage`, with the parameter server where the strategy's model is hosted
on the driver), go on with fewer workers where ``min_workers`` allows, and gather the
result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import pyarrow as pa
import torch

from sparkdl.config import DataConfig, SparkDLConfig
from sparkdl.data.columns import LabelKind
from sparkdl.data.inputs import DataPlan, TransformFn, plan_data
from sparkdl.data.tensors import Batch
from sparkdl.data.text import Tokenization, check_size, tokenization
from sparkdl.errors import (
    ConfigError,
    SchemaError,
    SparkDLError,
    TrainingFailedError,
    WeightTransferError,
    WorkersLostError,
)
from sparkdl.services.progress.board import announce
from sparkdl.spark.cluster import max_concurrent_tasks
from sparkdl.spark.environment import check_executor_environment
from sparkdl.spark.fit_task import RESULT_SCHEMA, TrainSpec, train_partition
from sparkdl.spark.independent import run_independent
from sparkdl.spark.preflight import check_label_range, check_model, label_range, sample_batch
from sparkdl.spark.ps_host import start_parameter_server
from sparkdl.spark.resize import Resize, check_resizable, next_size, note_resizes
from sparkdl.spark.stage import Site, raise_agreed_error, stage_input, training_site, training_stage
from sparkdl.spark.watch import SlotWatch
from sparkdl.strategies import check_settings, strategy_class
from sparkdl.strategies.pipeline_timing import cut_by_time, wants_time_cut
from sparkdl.training.factory import state_from_bytes
from sparkdl.training.schedules import LrPlan, lr_plan, needs_run_length, steps_per_epoch_estimate

log = logging.getLogger(__name__)


@dataclass
class FitResult:
    """What ``fit`` brings back to the driver: one copy of the weights, and figures."""

    state_dict: dict[str, torch.Tensor]
    history: list[dict[str, Any]]
    output_shape: tuple[int, ...]
    input_shapes: dict[str, tuple[int, ...]]
    worker_devices: list[dict[str, Any]]  # per rank: the device it trained on, the GPUs Spark gave it
    worker_rows: list[int]
    bad_rows_skipped: int = 0
    resizes: list[Resize] = dataclass_field(default_factory=list)  # restarts on fewer workers (min_workers)


def plan_inputs(
    df: Any,
    data: DataConfig,
    label_kind: LabelKind,
    transform_fn: TransformFn | None = None,
    with_label: bool = True,
    validation_col: str = "",
    next_token_of: str = "",
    tokenizer_json: bytes | None = None,
) -> DataPlan:
    """Check the DataFrame's schema on the driver, before any task starts, and decide how
    each column reaches the model (see :mod:`sparkdl.data.inputs`); with ``next_token_of``
    (``causal_lm``), that input's next tokens are the targets and no label column is read.
    ``data.tokenizer``'s file is read here, on the driver, and travels in the plan (or
    ``tokenizer_json``, that file as read before: a model's own copy)."""
    return plan_data(
        arrow_schema(df),
        feature_cols=data.feature_cols,
        inputs=data.inputs,
        input_shapes=data.input_shapes,
        sequence_cols=data.sequence_cols,
        max_sequence_length=data.max_sequence_length,
        label_col=data.label_col if with_label and not next_token_of else None,
        label_kind=label_kind,
        weight_col=(data.weight_col or None) if with_label else None,
        transform_fn=transform_fn,
        cache_transformed=data.cache_transformed,
        validation_col=validation_col or None,
        not_inputs=() if with_label else (data.label_col, data.weight_col),
        mask_input=data.mask_input,
        next_token_of=next_token_of,
        tokenizer=(
            tokenization(tokenizer_json, data.tokenizer, data.max_sequence_length)
            if tokenizer_json is not None and data.tokenizer
            else read_tokenizer(df.sparkSession, data)
        ),
        pad_to_max_length=data.pad_to_max_length,
    )


def read_tokenizer(spark: Any, data: DataConfig) -> Tokenization | None:
    """``data.tokenizer``'s file, read on the driver (executors may share no filesystem) and
    checked: None when unset.

    Raises:
        ConfigError: the file cannot be read, is too large or is no tokenizer.
    """
    if not data.tokenizer:
        return None
    from sparkdl.storage.fs import local_path, read_bytes

    local = local_path(data.tokenizer)
    try:
        if local is not None:  # a file too large is refused before it is read
            check_size(local.stat().st_size, data.tokenizer)
        raw = read_bytes(spark, data.tokenizer)
    except OSError as err:
        raise ConfigError(
            f"data.tokenizer = {data.tokenizer!r} cannot be read on the driver ({err}); give the path "
            "of a tokenizer.json the driver can read (local, or a Hadoop-supported URL)"
        ) from err
    return tokenization(raw, data.tokenizer, data.max_sequence_length)


def token_input(data: DataConfig) -> str:
    """The input ``causal_lm`` trains on: ``input_ids`` (a Hugging Face model's name), else
    the one sequence input.

    Raises:
        ConfigError: neither, or several sequence inputs and none of them ``input_ids``.
    """
    if "input_ids" in data.inputs:
        return "input_ids"
    sequences = [name for name, column in data.inputs.items() if column in data.sequence_cols]
    if len(sequences) == 1:
        return sequences[0]
    raise ConfigError(
        f"loss_fn = 'causal_lm' trains on the next tokens of one input of token ids: name it "
        f"input_ids, or feed one sequence (sequence inputs now: {sequences or 'none'}; "
        f"inputs = {data.inputs})"
    )


VALIDATION_MARK = "__sparkdl_validation__"


def with_validation(df: Any, config: SparkDLConfig, held_out: Any = None) -> tuple[Any, str]:
    """``df`` with the rows to validate marked, and the marking column ("" for none).

    The rows come from ``held_out`` (a DataFrame, appended to ``df``), the setting
    ``validation_col`` (the user's boolean column) or ``validation_fraction`` (a seeded
    draw per row, marked in the same pass that feeds training).
    """
    from pyspark.sql import functions as F

    training = config.training
    if held_out is not None:
        missing = [c for c in df.columns if c not in held_out.columns]
        if missing:
            raise SchemaError(
                f"the validation DataFrame lacks column(s) {missing} of the training DataFrame; "
                "give it the same columns"
            )
        marked = df.withColumn(VALIDATION_MARK, F.lit(False))
        return marked.unionByName(
            held_out.select(*df.columns).withColumn(VALIDATION_MARK, F.lit(True))
        ), VALIDATION_MARK
    if training.validation_col:
        return df, training.validation_col
    if training.validation_fraction:
        draw = F.rand(training.seed) < F.lit(training.validation_fraction)
        return df.withColumn(VALIDATION_MARK, draw), VALIDATION_MARK
    return df, ""


def vectors_as_arrays(df: Any) -> Any:
    """``df`` with every ml Vector column as array<float> (dense), converted in the JVM.

    A Vector column crosses into Python as a struct that Spark builds row by row, about ten
    times slower than an array column; the feed makes every Vector dense anyway.
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT

    vectors = [f.name for f in df.schema.fields if isinstance(f.dataType, VectorUDT)]
    if not vectors:
        return df
    return df.withColumns({name: vector_to_array(name, "float32") for name in vectors})


def arrow_schema(df: Any) -> pa.Schema:
    """The DataFrame's columns as Arrow types; a column Arrow cannot carry is left out (it
    is an error only if a setting names it: then it is "not found" with the list of
    columns that are there)."""
    from pyspark.sql.pandas.types import to_arrow_type

    fields = []
    for field in df.schema.fields:
        try:
            fields.append(pa.field(field.name, to_arrow_type(field.dataType)))
        except Exception as exc:
            log.debug("column %r (%s) cannot be sent as Arrow: %s", field.name, field.dataType, exc)
    return pa.schema(fields)


def run_training(df: Any, spec: TrainSpec) -> FitResult:
    """Train on ``df`` with one barrier task per worker; return rank 0's weights and history.

    The cluster's task slots are watched while the stage runs: once they have been short of
    ``num_workers`` for ``executor_wait_timeout_s`` (executors lost: their hosts gone, or the
    network between them and the driver cut), the stage is cancelled, as Spark would wait for
    them forever. With ``reliability.min_workers`` below ``num_workers`` it then starts again
    on the slots left, from the checkpoint (:mod:`sparkdl.spark.resize`); else fit raises
    :class:`WorkersLostError`."""
    config = check_settings(spec.config)
    n, runtime = config.training.num_workers, config.runtime
    spark = df.sparkSession
    site = training_site(spark, config)
    sample, cut = _preflight(df, spec)
    spec = dataclasses.replace(
        spec,
        config=cut or cut_by_time(spec.config, spec.model_fn, sample),  # pipeline_balance = "time"
        template=sample.head(2) if sample is not None else None,
        lr=_lr_plan(df, config),
    )
    floor = config.reliability.min_workers if 0 < config.reliability.min_workers < n else 0
    if floor:
        check_resizable(spark, config)
    resizes: list[Resize] = []
    while True:
        slots = None
        if not site.connect:  # watched at every size, the last one too: a further loss says so
            probe = functools.partial(max_concurrent_tasks, spark.sparkContext, site.profile)
            slots = SlotWatch(probe, n, runtime.executor_wait_timeout_s, resizes=bool(floor))
        try:
            result = _train(df, spec, site, slots)
        except SparkDLError as exc:
            if slots is None or not floor or len(resizes) > config.training.num_workers:
                raise
            try:
                workers = next_size(exc, slots.probe, n, floor, config.runtime.executor_wait_timeout_s)
            except WorkersLostError as lost:
                raise lost from exc
            if workers is None:
                raise
            spec = _resized(df, spec, n, workers, exc)
            resizes.append(Resize(n, workers, time.time(), f"{type(exc).__name__}: {exc}"))
            n = workers
            continue
        note_resizes(result.history, resizes)
        result.resizes = resizes
        return result


def _resized(df: Any, spec: TrainSpec, n: int, workers: int, cause: SparkDLError) -> TrainSpec:
    """``spec`` for a stage of ``workers`` workers, its settings checked again (a rule of the
    strategy may not hold for fewer workers, e.g. backup workers against the quorum).

    Raises:
        WorkersLostError: the settings do not hold for ``workers`` workers.
    """
    try:
        resized = check_settings(spec.config.replace(num_workers=workers))
    except ConfigError as refused:
        raise WorkersLostError(
            f"executors were lost: {workers} of {n} workers are left, and the settings do not hold for "
            f"{workers}: {refused}",
            available=workers,
            required=n,
        ) from cause
    log.warning(
        "the training stage of %d workers ended (%s); going on with %d from the last checkpoint",
        n, type(cause).__name__, workers,
    )  # fmt: skip
    return dataclasses.replace(spec, config=resized, lr=_lr_plan(df, resized))


def _train(df: Any, spec: TrainSpec, site: Site, slots: SlotWatch | None) -> FitResult:
    """One training stage of ``spec.config``'s workers, with its servers."""
    config = spec.config
    n = config.training.num_workers
    if not config.parameter_server.ps_barrier:  # async workers as ordinary tasks, each failing alone
        alone = run_independent(df, spec, site)
        result = _fit_result(alone.rows, n)
        result.state_dict.update(alone.weights)  # the server's weights over partition 0's buffers
        result.history[-1].update(alone.figures)
        return result
    hosted = None
    with contextlib.ExitStack() as stack:
        if strategy_class(config.training.strategy).hosted_on_driver:
            hosted = start_parameter_server(site.spark, spec, site.attempt_started)
            stack.callback(hosted.stop)
            spec = hosted.spec
        stage = stack.enter_context(training_stage(site, config))
        spec = dataclasses.replace(
            spec, weights=stage.weights, meeting=stage.meeting, progress=stage.progress_endpoint
        )
        data = stage_input(df, spec.plan.column_names, n)
        task = functools.partial(train_partition, spec)
        coordinator = hosted.coordinator if hosted is not None else None
        try:
            description = f"sparkdl fit: {n} workers, {_length(config)}"
            rows = stage.run(data, task, RESULT_SCHEMA, description, slots)
            result = _fit_result(rows, n, stage.uploaded())
        except SparkDLError as exc:  # L-BFGS on the shards: the driver's own error is the cause
            if coordinator is not None and coordinator.error is not None:
                raise coordinator_error(coordinator.error) from exc
            refusal = stage.upload_refusal()
            if isinstance(exc, WeightTransferError) and refusal:  # the worker saw its socket close
                raise WeightTransferError(f"{exc}; the driver's weights server refused it: {refusal}") from (
                    exc
                )
            raise
        if hosted is not None and coordinator is not None:  # the driver ran L-BFGS: its history, point
            result.history = coordinator.history
            result.state_dict.update(hosted.parameter_state())
        elif hosted is not None and "restored_epoch" not in result.history[-1]:
            # the server's weights are the newest (async pushes land after a worker's last pull);
            # after an early stop rank 0's copy of the best epoch wins
            result.state_dict.update(hosted.parameter_state())
        return result
    raise AssertionError("unreachable")  # pragma: no cover - the stack re-raises or returns


def _preflight(df: Any, spec: TrainSpec) -> tuple[Batch | None, SparkDLConfig | None]:
    """The DataFrame's first rows, decoded; with ``runtime.preflight``, mistakes that would
    fail every attempt fail here, once, in seconds: the executors' Python (a Spark job, one
    task per worker) is checked while the model runs on those rows here (driver CPU). Also
    the config with the pipeline's cut by measured time, where the check's model was timed
    (else None: :func:`cut_by_time` builds one)."""
    runtime = spec.config.runtime
    if not runtime.preflight:
        if runtime.progress:
            announce("reading the first rows (a Spark job)")
        return sample_batch(df, spec.plan), None
    if runtime.progress:
        announce(
            "checking before training (runtime.preflight): the first rows, the model on them here, "
            "the executors' Python"
        )
    sample = sample_batch(df, spec.plan)  # first: the check's tasks would hold every slot
    cut: list[SparkDLConfig] = []

    def time_the_cut(module: torch.nn.Module) -> None:
        if wants_time_cut(spec.config):
            cut.append(cut_by_time(spec.config, spec.model_fn, sample, whole=module))

    with ThreadPoolExecutor(2, thread_name_prefix="sparkdl-preflight") as pool:
        wait_s = max(runtime.executor_wait_timeout_s, 60.0)
        workers = spec.config.training.num_workers
        environment = pool.submit(check_executor_environment, df.sparkSession, wait_s, workers)
        labels = pool.submit(label_range, df, spec.plan)
        try:
            report = check_model(df, spec, sample, on_model=time_the_cut)
            check_label_range(labels.result(), report, spec.plan.label.name if spec.plan.label else "")
        finally:
            environment.result()  # a wrong environment is the first thing to fix: its error wins
    return sample, (cut[0] if cut else None)


def _lr_plan(df: Any, config: SparkDLConfig) -> LrPlan:
    """The run's learning-rate schedule; one that decays over the run needs its length, so
    the rows are counted first (one Spark job; epoch 1 streams, so no worker knows it yet)."""
    steps_per_epoch = 0
    if needs_run_length(config):
        rows = df.count()
        steps_per_epoch = steps_per_epoch_estimate(rows, config)
        log.info(
            "lr_schedule %s: %d rows, about %d steps per epoch, %d in the run",
            config.optimizer.lr_schedule.value,
            rows,
            steps_per_epoch,
            steps_per_epoch * config.training.epochs,
        )
    return lr_plan(config, steps_per_epoch)


def coordinator_error(error: BaseException) -> SparkDLError:
    """The error a fit raises for its L-BFGS coordinator's: the coordinator's own when it is
    sparkdl's (no rows, a non-finite objective), else wrapped with its type and text."""
    if isinstance(error, SparkDLError):
        return error
    return TrainingFailedError(f"the driver's L-BFGS coordinator failed: {type(error).__name__}: {error}")


def _length(config: SparkDLConfig) -> str:
    if config.optimizer.optimizer.value == "lbfgs":
        return f"L-BFGS, at most {config.lbfgs.max_iterations} iterations"
    return f"{config.training.epochs} epochs"


def _fit_result(rows: list[Any], n: int, uploaded: dict[str, torch.Tensor] | None = None) -> FitResult:
    """The fit's result from the rows of every rank, with rank 0's weights as it sent them
    to the weights server (``uploaded``) or, without one, from its result row."""
    raise_agreed_error(rows)
    by_rank = {row["rank"]: row for row in rows}
    if sorted(by_rank) != list(range(n)):
        raise TrainingFailedError(f"expected results from ranks 0..{n - 1}, got {sorted(by_rank)}")
    lead = by_rank[0]
    if lead["state"]:
        state = state_from_bytes(lead["state"])
    elif uploaded is not None:
        state = uploaded
    else:
        raise TrainingFailedError(
            "rank 0 finished but its trained weights never reached the driver's weights server; "
            "see the executor log of rank 0"
        )
    history = json.loads(lead["history"])
    per_worker = {r: json.loads(by_rank[r]["history"]) for r in range(n)}
    for i, record in enumerate(history):
        record["worker_samples"] = [per_worker[r][i]["local_samples"] for r in range(n)]
        record["worker_seconds"] = [per_worker[r][i]["seconds"] for r in range(n)]
        record["worker_nan_skips"] = [per_worker[r][i]["nan_skips"] for r in range(n)]
        record["worker_peak_gpu_mb"] = [per_worker[r][i].get("peak_gpu_mb", 0.0) for r in range(n)]
        record["worker_peak_host_mb"] = [per_worker[r][i].get("peak_host_mb", 0.0) for r in range(n)]
        record["worker_bytes_across_hosts"] = [
            per_worker[r][i].get("bytes_across_hosts", 0) for r in range(n)
        ]
        record["worker_skipped_steps"] = [per_worker[r][i].get("skipped_steps", 0) for r in range(n)]
        record["nan_skips"] = max(record["worker_nan_skips"])
        # backup workers: whichever ranks fell behind, the job's figures count them all
        record["skipped_steps"] = sum(record["worker_skipped_steps"])
        record["dropped_pushes"] = sum(per_worker[r][i].get("dropped_pushes", 0) for r in range(n))
        del record["local_samples"]
    return FitResult(
        state_dict=state,
        history=history,
        output_shape=tuple(json.loads(lead["output_shape"])),
        input_shapes={k: tuple(v) for k, v in json.loads(lead["input_shapes"]).items()},
        worker_devices=[json.loads(by_rank[r]["device"]) for r in range(n)],
        worker_rows=[int(by_rank[r]["rows"]) for r in range(n)],
        bad_rows_skipped=sum(int(by_rank[r]["bad_rows"]) for r in range(n)),
    )
