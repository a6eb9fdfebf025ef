"""The training stage carries its own GPU resource profile; the stages around it need no GPU."""

from __future__ import annotations

import pytest
import torch

from tests.spark.processes import run_drill

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def test_only_the_training_stage_holds_a_gpu_on_a_cluster_with_fake_gpus(tmp_path):
    result = run_drill("gpu_profile_drill.py", tmp_path, "fake")
    # ETL stages before and after fit run with the default profile: no GPU held
    assert result["etl_stage_gpus"] == [[], []]
    assert result["etl_after_fit_gpus"] == [[], []]
    # use_gpu = "auto": each training task got its executor's GPU through the stage's
    # profile; this torch has no CUDA, so it trained on CPU (and warned)
    # both executors on this host: the workers exchanged through shared memory
    # (the executors' address, where each process group bound: loopback here)
    cpu_with_gpu = {"device": "cpu", "gpus": ["0"], "exchange": "shared_memory", "host": "127.0.0.1"}
    assert result["auto"] == [cpu_with_gpu, cpu_with_gpu]
    for rank in (0, 1):  # the executors' warning reached the driver, with the rank
        assert any(
            w.startswith(f"[rank {rank}]") and "Spark assigned GPU 0 but this process sees no CUDA" in w
            for w in result["worker_warnings"]
        ), result["worker_warnings"]
    # use_gpu = false: no profile, no GPU
    assert (
        result["false"]
        == [{"device": "cpu", "gpus": [], "exchange": "shared_memory", "host": "127.0.0.1"}] * 2
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_real_gpus_each_task_trains_on_its_own_gpu_and_matches_the_cpu_run(tmp_path):
    result = run_drill("gpu_profile_drill.py", tmp_path, "real")
    gpus = min(torch.cuda.device_count(), 2)
    expected = [{"device": f"cuda:{i}", "gpus": [str(i)], "exchange": "nccl"} for i in range(gpus)]
    assert [{k: v for k, v in d.items() if k != "host"} for d in result["auto"]] == expected
    assert all(d["host"] for d in result["auto"])
    assert result["etl_stage_gpus"] == [[], []]
    for name, cpu_value in result["false_state"].items():  # same data and seed on CPU
        gpu_value = torch.tensor(result["auto_state"][name])
        assert torch.allclose(gpu_value, torch.tensor(cpu_value), atol=1e-4), name
