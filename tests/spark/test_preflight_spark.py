"""Preflight against a real Spark session: the sample the model is tried on, and the check
of the executors' Python (one that lacks sparkdl is caught in a child process with its own
SparkContext, since PYSPARK_PYTHON is fixed when a SparkContext starts)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sparkdl.config import SparkDLConfig
from sparkdl.data.columns import LabelKind
from sparkdl.errors import ModelMismatchError
from sparkdl.spark.driver import plan_inputs
from sparkdl.spark.environment import check_executor_environment, environment_job_group
from sparkdl.spark.preflight import check_label_range, check_model, label_range, sample_batch
from sparkdl.worker.assembly import TrainSpec
from tests.spark.processes import ROOT, spark_env, wait_for

pytestmark = pytest.mark.spark

CHILD_TIMEOUT_S = 300


def vectors_df(spark: Any, rows: int = 20) -> Any:
    from pyspark.ml.linalg import Vectors

    data = [
        (
            Vectors.sparse(3, [0], [float(i)]) if i % 2 else Vectors.dense([float(i), 1.0, 2.0]),
            [0.5, -0.5],
            i % 3,
        )
        for i in range(rows)
    ]
    return spark.createDataFrame(data, ["v", "a", "y"]).coalesce(1)


def test_sample_batch_decodes_the_first_rows_as_the_feed_does(spark):
    df = vectors_df(spark)
    plan = plan_inputs(
        df, SparkDLConfig().replace(feature_cols=("v", "a"), label_col="y").data, LabelKind.CLASS_INDEX
    )

    batch = sample_batch(df, plan, rows=4)
    x, y = batch.inputs["features"], batch.label

    expected = torch.tensor(
        [[0, 1, 2, 0.5, -0.5], [1, 0, 0, 0.5, -0.5], [2, 1, 2, 0.5, -0.5], [3, 0, 0, 0.5, -0.5]]
    )
    assert x.dtype == torch.float32 and torch.equal(x, expected)
    assert y.dtype == torch.int64 and y.tolist() == [0, 1, 2, 0]
    assert sample_batch(df.filter("y > 5"), plan) is None


def test_check_model_names_the_columns_of_the_dataframe(spark):
    df = vectors_df(spark)
    config = SparkDLConfig().replace(feature_cols=("v", "a"), label_col="y")
    plan = plan_inputs(df, config.data, LabelKind.REAL)
    fits = TrainSpec(config, lambda: nn.Linear(5, 1), None, "mse", plan)
    misfits = TrainSpec(config, lambda: nn.Linear(5, 3), None, "mse", plan)
    sample = sample_batch(df, plan)

    report = check_model(df, fits, sample)
    with pytest.raises(ModelMismatchError) as caught:
        check_model(df, misfits, sample)

    assert report is not None and report.output_shape == (1,) and report.rows == 8
    assert str(caught.value).startswith(
        "mse needs a label of shape (N, 3) for a 3-output model; the label column 'y' is one integer per row"
    )


def test_the_executors_of_the_test_session_pass_and_are_checked_once(spark):
    sc = spark.sparkContext

    first = check_executor_environment(spark, timeout_s=120)
    again = check_executor_environment(spark, timeout_s=120)

    assert first is not None and again is first
    assert first.torch == torch.__version__ and first.sparkdl
    assert len(sc.statusTracker().getJobIdsForGroup(environment_job_group(sc))) == 1


def python_without_torch() -> tuple[str, str]:
    """An interpreter of this Python's major.minor that cannot import torch (the path to set
    as PYSPARK_PYTHON and the ``sys.executable`` it reports); skip the test if none."""
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in dict.fromkeys([shutil.which("python3"), "/usr/bin/python3"]):
        if not candidate or Path(candidate).resolve() == Path(sys.executable).resolve():
            continue
        probe = "import sys; print(sys.executable); print('%d.%d' % sys.version_info[:2]); import torch"
        done = subprocess.run([candidate, "-c", probe], capture_output=True, text=True, timeout=60)
        lines = done.stdout.split()
        if done.returncode != 0 and len(lines) == 2 and lines[1] == mine:
            return candidate, lines[0]
    pytest.skip(f"no Python {mine} without torch on this machine")


def child_environment_check(out: str) -> None:
    """Run in a child process whose PYSPARK_PYTHON lacks torch and sparkdl: record the error
    and what Spark ran for the check."""
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
    sc = spark.sparkContext
    sc.setLogLevel("ERROR")
    record: dict[str, Any] = {}
    try:
        check_executor_environment(spark, timeout_s=120)
    except Exception as exc:
        record.update(error=type(exc).__name__, message=str(exc))
    tracker = sc.statusTracker()
    ids = tracker.getJobIdsForGroup(environment_job_group(sc))
    # The status tracker follows Spark's listener bus, which may lag the job's end a little.
    wait_for(
        "the check's job status", lambda: all(tracker.getJobInfo(j).status != "RUNNING" for j in ids), 60
    )
    jobs = [tracker.getJobInfo(j) for j in ids]
    stages = [tracker.getStageInfo(s) for job in jobs for s in job.stageIds]
    record["jobs"] = [job.status for job in jobs]
    record["stages"] = [
        [s.numTasks, s.numCompletedTasks, s.numFailedTasks, s.currentAttemptId] for s in stages
    ]
    Path(out).write_text(json.dumps(record))
    spark.stop()


def test_executors_without_sparkdl_fail_the_check_once_naming_pyspark_python(tmp_path):
    python, executable = python_without_torch()
    out = tmp_path / "result.json"
    code = "import sys; import tests.spark.test_preflight_spark as t; t.child_environment_check(sys.argv[1])"

    done = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        env=spark_env(tmp_path, PYSPARK_PYTHON=python),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )

    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["error"] == "ExecutorEnvironmentError"
    message = result["message"]
    assert message.startswith(f"executors run {executable} (")
    assert "torch cannot be imported" in message and "sparkdl cannot be imported" in message
    assert f"set PYSPARK_PYTHON (now {python!r})" in message and sys.executable in message
    # One job, one stage attempt, one task that succeeded: the import errors came back as
    # data, so Spark had nothing to retry.
    assert result["jobs"] == ["SUCCEEDED"] and result["stages"] == [[1, 1, 0, 0]]


def test_class_ids_the_first_rows_hide_fail_before_training_from_one_aggregate(spark):
    # The first 8 rows hold labels 0..4, which a 5-output model fits; a later row holds 7.
    rows = [([float(i), 1.0], i % 5) for i in range(40)] + [([0.5, 0.5], 7)]
    df = spark.createDataFrame(rows, "features array<float>, label long").coalesce(1)
    config = SparkDLConfig().replace(feature_cols=("features",), label_col="label")
    plan = plan_inputs(df, config.data, LabelKind.CLASS_INDEX)
    spec = TrainSpec(config, lambda: nn.Linear(2, 5), None, "cross_entropy", plan)
    sample = sample_batch(df, plan)
    assert sample is not None and int(sample.label.max()) == 4  # the first rows fit
    report = check_model(df, spec, sample)

    found = label_range(df, plan)
    assert found == (0.0, 7.0)
    with pytest.raises(ModelMismatchError) as caught:
        check_label_range(found, report, "label")
    assert str(caught.value) == (
        "the label column 'label' holds class ids up to 7 (over every row), but the model outputs 5 "
        "scores per row (classes 0..4); make its last layer output 8 values, or re-index the labels from 0"
    )
    check_label_range(label_range(df.filter("label < 5"), plan), report, "label")  # they fit
    regression = plan_inputs(df, config.data, LabelKind.REAL)
    assert label_range(df, regression) is None  # any value is a label: nothing to count
