"""Drills on one local-cluster of 2 executors x 2 slots with a fake GPU each, run once in its
own process (:mod:`tests.spark.local_cluster_drill`): the training stage's own GPU profile,
and hierarchical aggregation of 4 workers on the 2 executors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sparkdl.services.ps.protocol import PS_WIRE
from sparkdl.wire.framing import frame_bytes
from tests.reference import make_tiny_net
from tests.spark.processes import run_drill

pytestmark = [pytest.mark.spark, pytest.mark.slow]

MODEL_BYTES = 4 * sum(p.numel() for p in make_tiny_net().parameters())
HEADER_ONLY = frame_bytes(PS_WIRE.header.size, 0)  # a frame without payload, on the wire
STEPS = 2 * 7  # 2 epochs of the largest partition's 56 rows in batches of 8


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out: Path = tmp_path_factory.mktemp("local-cluster")
    return run_drill("local_cluster_drill.py", out)


def test_only_the_training_stage_holds_a_gpu_on_a_cluster_with_fake_gpus(drill):
    result = drill["gpu"]
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


def test_four_workers_on_two_executors_aggregate_per_executor_and_match_the_flat_runs(drill):
    result = drill["hierarchy"]
    for name, run in result.items():
        assert run["max_abs_diff"] < 1e-5, name  # every run: the flat all-reduce's weights
        # one machine: the flat runs exchange through shared memory, each executor's level too
        expected = "shared_memory" if name.endswith("flat") else "shared_memory+gloo"
        if name in ("parameter_server flat", "parameter_server shared memory"):  # they talk to the driver
            expected = "gloo"
        assert [d["exchange"] for d in run["devices"]] == [expected] * 4, name
    for strategy in ("allreduce", "weight_averaging"):
        across = result[f"{strategy} executor"]["across"]
        leaders = [rank for rank, sent in enumerate(across) if sent]
        assert len(leaders) == 2 and 0 in leaders  # one per executor; rank 0 leads its own
        # the two leaders' ring: one model's worth crosses per executor and sync, not more
        assert all(across[rank] == STEPS * MODEL_BYTES for rank in leaders)
    flat = result["parameter_server flat"]["across"]
    tree = result["parameter_server executor"]["across"]
    assert all(flat) and sum(1 for sent in tree if sent) == 2
    assert sum(tree) / sum(flat) == pytest.approx(0.5, rel=0.02)  # the driver receives half
    # executor processes that the workers' JVMs started found the driver's memory through /proc:
    # only the frames' headers crossed their sockets: a PUSH and a PULL a step, and the first pull
    shared = result["parameter_server shared memory"]["across"]
    assert all(0 < sent <= (STEPS + 1) * 2 * HEADER_ONLY for sent in shared), shared
    assert result["parameter_server shared memory"]["max_abs_diff"] < 1e-5
    print(f"FIGURE hierarchy driver bytes flat={sum(flat)} executor={sum(tree)}")
