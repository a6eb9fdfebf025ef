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
# Every JVM the tests start (drivers, local-cluster and standalone executors, spark-submit)
# compiles with C1 alone and collects serially: the tests' JVMs live seconds to minutes, where
# the optimizing compiler's work never pays back (on 2 cores: a local-cluster session 17 -> 9 s,
# a warm fit 4 -> 2.4 s). Test speed only: users' JVMs keep Java's defaults.
os.environ.setdefault("JDK_JAVA_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local[2] SparkSession with the settings sparkdl recommends and short timeouts."""
    from sparkdl.config import SparkDLConfig
    from sparkdl.spark.session import build_session

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


# What a worker or fit could set and must restore (libraries set others of their own at
# import, e.g. KMP_* and TORCHINDUCTOR_CACHE_DIR, which are not ours to police).
_WATCHED_ENV = (
    "GLOO_",
    "NCCL_",
    "TORCH_NCCL_",
    "MASTER_",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
    "PYSPARK_PYTHON",
    "PYSPARK_DRIVER_PYTHON",
    "MLFLOW_",
    "SPARKDL_",
)


@pytest.fixture(autouse=True)
def no_leaked_process_group_threads_or_environment() -> Iterator[None]:
    """Fail a test that leaves a torch.distributed group, a sparkdl thread or a changed
    environment variable (e.g. GLOO_SOCKET_IFNAME set by a worker) behind."""
    import torch.distributed as dist

    before = dict(os.environ)
    yield
    assert not (dist.is_available() and dist.is_initialized()), "test leaked a process group"
    # a worker run in this process leaves its epoch cache's memory to the next one, watched by
    # the pool's releaser thread (by design: data.cache_memory_keep_s); hand it back first
    from sparkdl.data.pool import shared_pool

    shared_pool().clear()
    leaked = [t.name for t in threading.enumerate() if t.name.startswith("sparkdl-") and t.is_alive()]
    assert not leaked, f"test leaked threads: {leaked}"
    after = dict(os.environ)
    changed = {
        name: (before.get(name), after.get(name))
        for name in set(before) | set(after)
        if before.get(name) != after.get(name) and name.startswith(_WATCHED_ENV)
    }
    assert not changed, f"test leaked environment variables (before, after): {changed}"


@pytest.fixture
def gloo_group() -> Iterator[None]:
    """A one-process gloo process group on loopback (the default group), destroyed after."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()
