"""A real standalone cluster on loopback: a master and a worker started with PySpark's own
``sbin/spark-daemon.sh`` (what ``start-master.sh`` / ``start-worker.sh`` run), whose own Python
has neither torch nor sparkdl; the main job submitted to it with ``spark-submit``, the
environment it needs packed by ``scripts/pack_env.sh`` from sparkdl's wheel and shipped with
``--archives``, as a user's first cluster run goes; then the cluster stopped."""

from __future__ import annotations

import json
import os
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
    """Its daemons, and so its executors, run in ``env`` (the workers' own environment):
    this interpreter with this repository on the path, or ``python`` (a bare one, whose
    executors get sparkdl shipped)."""

    def __init__(self, base: Path, python: str | None = None, workers: int = 2, cores: int = 1) -> None:
        import pyspark

        self.home = Path(pyspark.__file__).parent
        self.logs = base / "logs"
        self.work = base / "work"
        own = spark_env(base)
        if python is not None:
            own["PYSPARK_PYTHON"] = python
            own.pop("PYTHONPATH")  # not this repository's sparkdl: the executors get theirs shipped
        self.env = {
            **own,
            "SPARK_HOME": str(self.home),
            "SPARK_LOG_DIR": str(self.logs),
            "SPARK_PID_DIR": str(base / "pids"),
            "SPARK_IDENT_STRING": "sparkdl-test",
        }
        self.workers = tuple(range(1, workers + 1))  # spark-daemon.sh's instance numbers
        self.cores = cores
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
        for instance in self.workers:
            self.daemon(
                "start", WORKER, instance, "--host", "127.0.0.1", "--cores", str(self.cores),
                "--memory", f"{self.cores}g", "--webui-port", "0", self.url,
            )  # fmt: skip
        for instance in self.workers:
            wait_for(
                f"worker {instance}",
                lambda i=instance: "Successfully registered with master" in self.log_text(WORKER, i),
            )

    def stop(self) -> None:
        for instance in self.workers:
            self.daemon("stop", WORKER, instance)
        self.daemon("stop", MASTER, 1)


@pytest.fixture
def bare_python(tmp_path: Path) -> str:
    """The workers' own Python: a new virtual environment, without torch and without sparkdl."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    python = str(tmp_path / "bare/bin/python")
    for module in ("torch", "sparkdl"):
        found = subprocess.run([python, "-c", f"import {module}"], capture_output=True, env={}, cwd=tmp_path)
        assert found.returncode != 0, f"the workers' own Python must lack {module}"
    return python


@pytest.fixture
def cluster(tmp_path: Path, bare_python: str) -> Iterator[StandaloneCluster]:
    # one worker of two cores: one executor JVM runs both training tasks (the shipped
    # environment is unpacked there and on the driver; a second worker would unpack it again)
    standalone = StandaloneCluster(tmp_path, bare_python, workers=1, cores=2)
    standalone.start()
    try:
        yield standalone
    finally:
        standalone.stop()
    wait_for("master port to close", lambda: not port_open(standalone.port), 30)
    assert not list((tmp_path / "pids").glob("*.pid"))  # spark-daemon.sh removed every pid file


def test_spark_submit_trains_on_a_standalone_cluster_whose_python_lacks_torch_and_sparkdl(cluster, tmp_path):
    """What docs/guide/install.md tells a user: pack the environment from the wheel, ship it
    with --archives, point the executors' Python at it; the main job trains to its accuracy."""
    archive = tmp_path / "sparkdl-env.tar.gz"
    settings = {
        "OUTPUT": str(archive),
        "PYTHON": sys.executable,
        "COMPILE_BYTECODE": "0",
        "COMPRESS_LEVEL": "1",
    }
    packed = subprocess.run(
        ["bash", str(ROOT / "scripts/pack_env.sh")],
        env={**os.environ, **settings},  # sources only, gzip's fastest: packed in half the time
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert packed.returncode == 0, packed.stdout[-2000:] + packed.stderr[-4000:]
    assert not list(ROOT.glob("build/lib/sparkdl"))  # the wheel was built outside the repository
    spark_submit = Path(sys.executable).with_name("spark-submit")
    env = cluster.env
    command = [
        str(spark_submit),
        "--master", cluster.url,
        "--archives", f"{archive}#environment",
        "--conf", "spark.pyspark.python=./environment/bin/python",
        "--conf", f"spark.pyspark.driver.python={sys.executable}",  # the driver: this environment
        "--conf", "spark.driver.host=127.0.0.1",
        "--conf", "spark.ui.enabled=false",
        "--conf", "spark.executor.cores=2",
        "--conf", "spark.executor.memory=2g",
        "--conf", "spark.python.daemon.module=sparkdl.spark.daemon",  # as the clusters guide says
        str(ROOT / "jobs/train.py"),
        "--config", str(ROOT / "conf/cluster.toml"),
        "--set", "training.num_workers=2",
        "--set", "training.epochs=10",
        "--set", "runtime.executor_wait_timeout_s=90",
        "--output", str(tmp_path / "out"),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=500, cwd=tmp_path)
    assert done.returncode == 0, _first_exception(done.stderr)
    metrics = json.loads((tmp_path / "out/metrics.json").read_text())
    assert metrics["test_accuracy"] >= 0.93
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert errors == []  # a successful job's log is clean at the default level
    assert metrics["history"][-1]["worker_samples"][0] > 0 and metrics["history"][-1]["worker_samples"][1] > 0
    # the worker ran the application's executor, in the environment shipped to it
    assert "Asked to launch executor app-" in cluster.log_text(WORKER, 1)
    unpacked = sorted(cluster.work.glob("app-*/*/environment/bin/python"))
    assert len(unpacked) == 1, unpacked


def _first_exception(stderr: str) -> str:
    """The first Java or Python exception of a failed job's output, and its end."""
    at = min((i for i in (stderr.find("Exception"), stderr.find("Traceback")) if i >= 0), default=0)
    return stderr[max(at - 300, 0) : at + 2500] + "\n...\n" + stderr[-1500:]
