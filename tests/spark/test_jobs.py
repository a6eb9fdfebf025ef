"""The main job: in-process on local[2], and through spark-submit on local-cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from sparkdl import TorchModel
from sparkdl.apps.models import MLPFactory
from sparkdl.apps.train_job import load_job_config, run_advise_job, run_train_job
from tests.spark.processes import spark_env

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.spark


def test_main_job_reaches_95_percent_held_out_accuracy_on_digits(spark, tmp_path):
    config = load_job_config(ROOT / "conf/local.toml")
    metrics = run_train_job(config, tmp_path, spark=spark)
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["test_accuracy"] == metrics["test_accuracy"]
    assert metrics["test_accuracy"] >= 0.95
    assert metrics["train_rows"] + metrics["test_rows"] == 1797
    assert len(metrics["history"]) == config.sparkdl.training.epochs
    assert metrics["history"][-1]["loss"] < metrics["history"][0]["loss"]
    job = config.job
    model = TorchModel.load(str(tmp_path / "model"), model_fn=MLPFactory(64, job.hidden, 10, job.dropout))
    assert model.history == metrics["history"]
    picture = plt.imread(tmp_path / "history.png")  # written next to metrics.json
    assert picture.shape[:2] == (400, 1000)


@pytest.mark.slow
def test_the_main_job_advises_a_strategy_instead_of_training(spark, tmp_path):
    config = load_job_config(ROOT / "conf/local.toml")
    summary = run_advise_job(config, tmp_path, spark=spark, steps=8, budget_s=0.05)  # a short probe
    advice = json.loads((tmp_path / "advice.json").read_text())
    assert summary["recommended"] == advice["recommended"]
    names = {row["name"] for row in advice["rows"]}
    assert {"allreduce", "weight_averaging tau=16", "parameter_server sync", "fsdp"} <= names
    chosen = next(row for row in advice["rows"] if row["name"] == advice["recommended"])
    assert chosen["exact"] and summary["samples_per_s"] == chosen["samples_per_s"] > 0
    assert set(advice["projections"]["allreduce"]) == {"8", "32", "128"}
    assert not (tmp_path / "model").exists()  # advice only: nothing trained, nothing saved


@pytest.mark.slow
def test_weight_averaging_every_8_steps_is_within_2_points_of_allreduce(spark, tmp_path):
    base = run_train_job(load_job_config(ROOT / "conf/local.toml"), tmp_path / "allreduce", spark=spark)
    overrides = ['training.strategy="weight_averaging"', "weight_averaging.sync_every=8"]
    local_sgd = run_train_job(
        load_job_config(ROOT / "conf/local.toml", overrides), tmp_path / "wa", spark=spark
    )
    assert local_sgd["config"]["strategy"] == "weight_averaging"
    assert abs(local_sgd["test_accuracy"] - base["test_accuracy"]) <= 0.02
    steps = sum(epoch["steps"] for epoch in base["history"])
    assert sum(epoch["sync_rounds"] for epoch in base["history"]) == steps
    # every 8th step, plus the final average of the steps after the last one
    assert sum(epoch["sync_rounds"] for epoch in local_sgd["history"]) == steps // 8 + (steps % 8 > 0)
    bytes_per_sample = [
        sum(e["bytes_sent"] for e in run["history"]) / sum(e["samples"] for e in run["history"])
        for run in (base, local_sgd)
    ]
    # the job's SGD has momentum, averaged with the weights: twice the payload per round
    assert bytes_per_sample[1] / bytes_per_sample[0] == pytest.approx(2 / 8, rel=0.05)


@pytest.fixture(scope="module")
def allreduce_accuracy(spark, tmp_path_factory):
    config = load_job_config(ROOT / "conf/local.toml")
    return run_train_job(config, tmp_path_factory.mktemp("allreduce"), spark=spark)["test_accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ['parameter_server.ps_mode="sync"'],
        [
            'parameter_server.ps_mode="async"',
            "parameter_server.push_every=2",
            "parameter_server.pull_every=2",
        ],
        ['parameter_server.ps_mode="ssp"', "parameter_server.staleness=2"],
    ],
    ids=["sync", "async", "ssp"],
)
def test_parameter_server_modes_are_within_2_points_of_allreduce(
    spark, tmp_path, allreduce_accuracy, overrides
):
    config = load_job_config(ROOT / "conf/local.toml", ['training.strategy="parameter_server"', *overrides])
    metrics = run_train_job(config, tmp_path, spark=spark)
    assert abs(metrics["test_accuracy"] - allreduce_accuracy) <= 0.02
    history = metrics["history"]
    assert all(h["pushes"] > 0 and h["pulls"] > 0 and h["bytes_received"] > 0 for h in history)
    if config.sparkdl.parameter_server.ps_mode.value == "sync":
        assert all(h["staleness_max"] == 0 for h in history)
    # the server stopped with fit: its thread and port are gone
    assert not any(t.name.startswith("sparkdl-ps") and t.is_alive() for t in threading.enumerate())


@pytest.mark.twin
def test_spark_submit_runs_the_job_on_local_cluster_executors(tmp_path):
    """Separate executor JVMs and Python workers: the real multi-process path. Its twin in the
    default run, tests/spark/test_standalone_cluster.py, submits the same job to an executor JVM
    of its own (a standalone master's, whose Python gets sparkdl shipped) and checks the same:
    the accuracy, and a log without an ERROR line (``pytest -m twin`` runs this one)."""
    spark_submit = Path(sys.executable).with_name("spark-submit")
    env = spark_env(tmp_path, PYSPARK_DRIVER_PYTHON=sys.executable)
    command = [
        str(spark_submit),
        "--master",
        "local-cluster[2,1,1024]",
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        "spark.driver.host=127.0.0.1",
        str(ROOT / "jobs/train.py"),
        "--config",
        str(ROOT / "conf/local.toml"),
        "--set",
        'spark.master=""',
        "--set",
        "training.epochs=10",
        "--set",
        "runtime.executor_wait_timeout_s=60",
        "--output",
        str(tmp_path / "out"),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = json.loads((tmp_path / "out/metrics.json").read_text())
    assert metrics["test_accuracy"] >= 0.93
    summary = json.loads(done.stdout[done.stdout.index("{") :])
    assert summary["test_accuracy"] == metrics["test_accuracy"]
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert errors == []  # a successful job's log is clean at the default level


def test_python_job_reports_config_errors_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nepochz = 3\n")
    done = subprocess.run(
        [sys.executable, str(ROOT / "jobs/train.py"), "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "unknown key 'epochz'; did you mean 'epochs'?" in done.stderr and "Traceback" not in done.stderr
