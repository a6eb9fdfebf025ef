"""Helpers for tests that run Spark in child processes: drills, clusters, servers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def spark_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment, with executors on this interpreter, Spark on loopback, and
    the repository importable (ahead of any ``PYTHONPATH`` already set)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_WORKER_DIR": str(tmp_path / "work"),
        "PYTHONPATH": path,
        **extra,
    }


def run_drill(script: str, tmp_path: Path, *args: str, timeout: float = 500) -> dict[str, Any]:
    """Run ``tests/spark/<script> tmp_path *args`` in its own process (its own
    SparkContext); return the ``result.json`` it wrote to ``tmp_path``."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/spark" / script), str(tmp_path), *args],
        env=spark_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((tmp_path / "result.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready after {timeout_s:.0f}s")
