"""Shared fixtures: a real local Spark session, and hygiene checks on every test."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

# Spark and the process groups talk over loopback only.
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no network at test time


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local[2] SparkSession with the settings sparkdl recommends and short timeouts."""
    from sparkdl.config import SparkDLConfig
    from sparkdl.runtime.session import build_session

    config = SparkDLConfig().replace(collective_timeout_s=60.0)
    warehouse = tmp_path_factory.mktemp("warehouse")
    session = build_session(
        "local[2]",
        "sparkdl-tests",
        config,
        {
            "spark.ui.enabled": "false",
            "spark.sql.warehouse.dir": str(warehouse),
            "spark.driver.host": "127.0.0.1",
        },
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(autouse=True)
def no_leaked_process_group_or_threads() -> Iterator[None]:
    """Fail a test that leaves a torch.distributed group or a prefetch thread behind."""
    import torch.distributed as dist

    yield
    assert not (dist.is_available() and dist.is_initialized()), "test leaked a process group"
    leaked = [t.name for t in threading.enumerate() if t.name.startswith("sparkdl-") and t.is_alive()]
    assert not leaked, f"test leaked threads: {leaked}"
