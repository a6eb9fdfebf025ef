"""Shared fixtures: a real local Spark session, and hygiene checks on every test."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
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


def pytest_configure(config: pytest.Config) -> None:
    """Before any JVM starts: the class-data-sharing archive of Spark's classes (built once per
    Java and Spark, in the background, :mod:`tests.jvm_archive`) joins every test JVM's
    options. The xdist processes inherit the controller's environment.
    ``SPARKDL_TESTS_JVM_ARCHIVE=off``: without it."""
    if (
        hasattr(config, "workerinput")
        or "SharedArchiveFile" in os.environ["JDK_JAVA_OPTIONS"]
        or os.environ.get("SPARKDL_TESTS_JVM_ARCHIVE") == "off"
    ):
        return
    from tests.jvm_archive import USE, Builder

    cache = getattr(config, "cache", None)  # absent under -p no:cacheprovider
    folder = (
        Path(str(cache.mkdir("jvm-archive"))) if cache else Path(tempfile.gettempdir(), "sparkdl-jvm-archive")
    )
    builder = Builder(folder)
    config.add_cleanup(builder.stop)
    if builder.path is not None:
        os.environ["JDK_JAVA_OPTIONS"] += " " + USE.format(path=builder.path)


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


#: The heaviest test files, heaviest first, with their seconds in a full run (session 33: 3
#: processes on 2 cores, ``pytest --junitxml``, summed per file). xdist hands out whole files
#: in collection order (``--no-loadscope-reorder``; by default it reorders by number of tests,
#: which sent the one-test cluster files last): started first, they end near the suite's total
#: over three, and the many short files fill each process's end. A new file that takes more than
#: a minute belongs here.
HEAVIEST_FIRST = (
    "tests/spark/test_reliability.py",  # 335 s
    "tests/spark/test_cluster_faults.py",  # 248 s
    "tests/multihost/test_netlab.py",  # 243 s
    "tests/spark/test_standalone_cluster.py",  # 198 s
    "tests/spark/test_fit.py",  # 194 s
    "tests/spark/test_large_model.py",  # 139 s
    "tests/spark/test_jobs.py",  # 138 s
    "tests/spark/test_distributor.py",  # 121 s
    "tests/spark/test_inputs_spark.py",  # 110 s
    "tests/spark/test_independent_ps.py",  # 79 s (-n0, loaded)
    "tests/spark/test_streaming_fit.py",  # 77 s (-n0, loaded)
    "tests/unit/test_fsdp.py",  # 80 s
    "tests/spark/test_local_cluster.py",  # 110 s (session 37: two drills, one cluster)
    "tests/spark/test_notebook.py",  # 76 s
    "tests/spark/test_session.py",  # 67 s
    "tests/unit/test_frozen_parameters.py",  # 60 s
    "tests/spark/test_connect.py",  # 59 s
    "tests/spark/test_readme.py",  # 57 s
    "tests/unit/test_own_loop.py",  # 52 s
    "tests/unit/test_tensor_parallel.py",  # 50 s
    "tests/unit/test_security.py",  # 48 s
    "tests/spark/test_examples.py",  # 47 s
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The heaviest files first (:data:`HEAVIEST_FIRST`), the rest in collection order."""
    rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))
