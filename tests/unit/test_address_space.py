"""Python workers under spark.executor.pyspark.memory reserve no address space ahead of use
(sparkdl/worker/address_space.py): each case runs in a fresh interpreter, as a forked worker
starts, since pyarrow fixes its pool at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sparkdl.spark.session import PYSPARK_MEMORY, recommended_conf
from sparkdl.worker.address_space import UNDER_A_LIMIT

WORKER = """
import json, os, sys
from sparkdl.worker.address_space import reserve_less_before_forking

def address_space_mb():
    return int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) / 1024

did = reserve_less_before_forking()
import pyarrow as pa  # as a worker imports it, after the daemon's fork
before = address_space_mb()
pa.array(range(1000))  # the first allocation from Arrow's default pool
print(json.dumps({"did": did, "pool": pa.default_memory_pool().backend_name,
                  "grew_mb": address_space_mb() - before}))
"""


def run_worker(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in {"PYSPARK_EXECUTOR_MEMORY_MB", *UNDER_A_LIMIT}}
    done = subprocess.run(
        [sys.executable, "-c", WORKER], env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_limited_worker_allocates_arrow_memory_without_reserving_a_gibibyte():
    free = run_worker()
    assert not free["did"] and free["pool"] == "mimalloc"
    assert free["grew_mb"] > 900, free  # mimalloc's arena: the address space a limit counts
    limited = run_worker(PYSPARK_EXECUTOR_MEMORY_MB="2600")
    assert limited["did"] and limited["pool"] == "system"
    assert limited["grew_mb"] < 64, limited
    kept = run_worker(PYSPARK_EXECUTOR_MEMORY_MB="2600", ARROW_DEFAULT_MEMORY_POOL="jemalloc")
    assert kept["pool"] == "jemalloc"  # what the environment already says is kept


def test_a_session_with_a_python_memory_limit_gives_its_executors_the_environment(monkeypatch):
    from sparkdl.config import SparkDLConfig
    from sparkdl.spark import session

    built: dict[str, str] = {}

    class Builder:
        def appName(self, _):
            return self

        def master(self, _):
            return self

        def config(self, key, value):
            built[key] = value
            return self

        def getOrCreate(self):
            return built

    import pyspark.sql

    monkeypatch.setattr(pyspark.sql.SparkSession, "builder", Builder())
    session.build_session("local[2]", "t", SparkDLConfig(), {PYSPARK_MEMORY: "2g"})
    assert {f"spark.executorEnv.{k}": v for k, v in UNDER_A_LIMIT.items()}.items() <= built.items()
    assert built["spark.python.daemon.module"] == "sparkdl.spark.daemon"
    built.clear()
    session.build_session("local[2]", "t", SparkDLConfig(), {})
    assert not any(key.startswith("spark.executorEnv.") for key in built), built
    assert recommended_conf(SparkDLConfig()).keys() <= built.keys()
