"""The training stage carries its own GPU resource profile; the stages around it need no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def test_only_the_training_stage_holds_a_gpu_on_a_cluster_with_fake_gpus(tmp_path):
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_WORKER_DIR": str(tmp_path / "work"),
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/spark/gpu_profile_drill.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    # ETL stages before and after fit run with the default profile: no GPU held
    assert result["etl_stage_gpus"] == [[], []]
    assert result["etl_after_fit_gpus"] == [[], []]
    # use_gpu = "auto": each training task got its executor's GPU through the stage's
    # profile; this torch has no CUDA, so it trained on CPU (and warned)
    assert result["auto"] == [{"device": "cpu", "gpus": ["0"]}, {"device": "cpu", "gpus": ["0"]}]
    for rank in (0, 1):  # the executors' warning reached the driver, with the rank
        assert any(
            w.startswith(f"[rank {rank}]") and "Spark assigned GPU 0 but this process sees no CUDA" in w
            for w in result["worker_warnings"]
        ), result["worker_warnings"]
    # use_gpu = false: no profile, no GPU
    assert result["false"] == [{"device": "cpu", "gpus": []}, {"device": "cpu", "gpus": []}]
