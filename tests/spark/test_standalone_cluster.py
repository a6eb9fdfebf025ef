"""A real standalone cluster on loopback: a master and two workers started with PySpark's own
``sbin/spark-daemon.sh`` (what ``start-master.sh`` / ``start-worker.sh`` run), the main job
submitted to it with ``spark-submit``, then the cluster stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.spark.processes import ROOT, free_port, port_open, spark_env, wait_for

pytestmark = [pytest.mark.spark, pytest.mark.slow]

MASTER = "org.apache.spark.deploy.master.Master"
WORKER = "org.apache.spark.deploy.worker.Worker"


class StandaloneCluster:
    def __init__(self, base: Path) -> None:
        import pyspark

        self.home = Path(pyspark.__file__).parent
        self.logs = base / "logs"
        self.env = spark_env(
            base,
            SPARK_HOME=str(self.home),
            SPARK_LOG_DIR=str(self.logs),
            SPARK_PID_DIR=str(base / "pids"),
            SPARK_IDENT_STRING="sparkdl-test",
        )
        self.port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"

    def daemon(self, action: str, cls: str, instance: int, *args: str) -> None:
        script = self.home / "sbin/spark-daemon.sh"
        done = subprocess.run(
            ["bash", str(script), action, cls, str(instance), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr

    def log_text(self, cls: str, instance: int) -> str:
        found = list(self.logs.glob(f"*{cls}-{instance}-*.out"))
        return found[0].read_text(errors="replace") if found else ""

    def start(self) -> None:
        self.daemon("start", MASTER, 1, "--host", "127.0.0.1", "--port", str(self.port), "--webui-port", "0")
        wait_for("master", lambda: port_open(self.port))
        for instance in (1, 2):
            self.daemon(
                "start", WORKER, instance, "--host", "127.0.0.1", "--cores", "1", "--memory", "1g",
                "--webui-port", "0", self.url,
            )  # fmt: skip
        for instance in (1, 2):
            wait_for(
                f"worker {instance}",
                lambda i=instance: "Successfully registered with master" in self.log_text(WORKER, i),
            )

    def stop(self) -> None:
        for instance in (1, 2):
            self.daemon("stop", WORKER, instance)
        self.daemon("stop", MASTER, 1)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[StandaloneCluster]:
    standalone = StandaloneCluster(tmp_path)
    standalone.start()
    try:
        yield standalone
    finally:
        standalone.stop()
    wait_for("master port to close", lambda: not port_open(standalone.port), 30)
    assert not list((tmp_path / "pids").glob("*.pid"))  # spark-daemon.sh removed every pid file


def test_spark_submit_trains_on_a_standalone_master_with_two_workers(cluster, tmp_path):
    spark_submit = Path(sys.executable).with_name("spark-submit")
    env = {**cluster.env, "PYSPARK_DRIVER_PYTHON": sys.executable}
    command = [
        str(spark_submit),
        "--master", cluster.url,
        "--conf", "spark.driver.host=127.0.0.1",
        "--conf", "spark.ui.enabled=false",
        "--conf", "spark.executor.cores=1",
        "--conf", "spark.executor.memory=1g",
        "--conf", "spark.python.daemon.module=sparkdl.spark.daemon",  # as the clusters guide says
        str(ROOT / "jobs/train.py"),
        "--config", str(ROOT / "conf/cluster.toml"),
        "--set", "training.num_workers=2",
        "--set", "training.epochs=10",
        "--set", "runtime.executor_wait_timeout_s=90",
        "--output", str(tmp_path / "out"),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=500, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = json.loads((tmp_path / "out/metrics.json").read_text())
    assert metrics["test_accuracy"] >= 0.93
    assert metrics["history"][-1]["worker_samples"][0] > 0 and metrics["history"][-1]["worker_samples"][1] > 0
    # both workers ran an executor for the application
    for instance in (1, 2):
        assert "Asked to launch executor app-" in cluster.log_text(WORKER, instance)
