"""Faults that need executors in their own JVMs: a local-cluster in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def test_losing_an_executor_jvm_resumes_from_the_checkpoint_with_identical_weights(tmp_path):
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_WORKER_DIR": str(tmp_path / "work"),
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/spark/executor_loss_drill.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["fired"]
    assert result["max_abs_diff"] == 0.0
    resumed = result["resumed"]
    assert resumed["resumed_from_step"] == 8 and resumed["steps_redone"] == 2
    print(
        f"FIGURE executor-loss redone={resumed['steps_redone']} recovery_s={resumed['recovery_s']:.2f} "
        f"clean_s={result['clean_s']:.2f} drilled_s={result['drilled_s']:.2f}"
    )
