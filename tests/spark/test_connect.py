"""fit/transform over Spark Connect: a Connect server started with PySpark's own
``sbin/start-connect-server.sh`` on loopback, a client process using ``builder.remote``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.spark.processes import ROOT, free_port, port_open, spark_env, wait_for

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture
def connect_server(tmp_path):
    pytest.importorskip("grpc", reason="Spark Connect needs the 'connect' extra (pyspark[connect])")
    import pyspark

    home = Path(pyspark.__file__).parent
    port = free_port()
    env = spark_env(
        tmp_path,
        SPARK_HOME=str(home),
        SPARK_LOG_DIR=str(tmp_path / "logs"),
        SPARK_PID_DIR=str(tmp_path / "pids"),
        SPARK_IDENT_STRING="sparkdl-test",
    )
    start = [
        "bash", str(home / "sbin/start-connect-server.sh"),
        "--master", "local[2]",
        "--conf", f"spark.connect.grpc.binding.port={port}",
        "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf", "spark.driver.host=127.0.0.1",
        "--conf", "spark.ui.enabled=false",
        "--conf", "spark.barrier.sync.timeout=300",
    ]  # fmt: skip
    done = subprocess.run(start, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    try:
        wait_for("Spark Connect server", lambda: port_open(port), 120)
        yield f"sc://127.0.0.1:{port}", env
    finally:
        subprocess.run(
            ["bash", str(home / "sbin/stop-connect-server.sh")], env=env, capture_output=True, timeout=60
        )
        wait_for("Connect port to close", lambda: not port_open(port), 30)


def test_fit_and_transform_work_over_spark_connect_and_the_parameter_server_says_why_not(
    connect_server, tmp_path
):
    url, env = connect_server
    out = tmp_path / "connect.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/spark/connect_client.py"), url, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["session"] == "pyspark.sql.connect.session"
    for strategy in ("allreduce", "weight_averaging"):
        run = results[strategy]
        assert run["losses"][-1] < 0.6 * run["losses"][0], run["losses"]
        assert sum(run["worker_samples"]) == 2000 and min(run["worker_samples"]) > 0
        assert run["columns"] == ["features", "label", "prediction", "rawPrediction", "probability"]
        assert run["rows"] == 500
        assert run["accuracy"] >= 0.85
    # your own code over Connect: the distributor's ranks meet and its state dict comes back
    assert results["distributor"] == {"total": [6.0], "world": [2]}
    run = results["run"]
    assert run["keys"] == ["body.0.bias", "body.0.weight", "body.2.bias", "body.2.weight"]
    assert run["devices"] == ["cpu", "cpu"] and sum(run["losses"][-5:]) < sum(run["losses"][:5])
    assert "Spark Connect client cannot run code" in results["parameter_server"]
    assert "use strategy 'allreduce' or 'weight_averaging'" in results["parameter_server"]
