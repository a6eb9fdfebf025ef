"""The training stage carries its own GPU resource profile on a machine's real GPUs (with fake
ones: tests/spark/test_local_cluster.py)."""

from __future__ import annotations

import pytest
import torch

from tests.spark.processes import run_drill

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_real_gpus_each_task_trains_on_its_own_gpu_and_matches_the_cpu_run(tmp_path):
    result = run_drill("gpu_profile_drill.py", tmp_path)
    gpus = min(torch.cuda.device_count(), 2)
    expected = [{"device": f"cuda:{i}", "gpus": [str(i)], "exchange": "nccl"} for i in range(gpus)]
    assert [{k: v for k, v in d.items() if k != "host"} for d in result["auto"]] == expected
    assert all(d["host"] for d in result["auto"])
    assert result["etl_stage_gpus"] == [[], []]
    for name, cpu_value in result["false_state"].items():  # same data and seed on CPU
        gpu_value = torch.tensor(result["auto_state"][name])
        assert torch.allclose(gpu_value, torch.tensor(cpu_value), atol=1e-4), name
