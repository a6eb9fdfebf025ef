"""Hierarchical aggregation on a local-cluster of 2 executors x 2 slots (its own process)."""

from __future__ import annotations

import pytest

from sparkdl.services.ps.protocol import PS_WIRE
from sparkdl.wire.framing import frame_bytes
from tests.reference import make_tiny_net
from tests.spark.processes import run_drill

pytestmark = [pytest.mark.spark, pytest.mark.slow]

MODEL_BYTES = 4 * sum(p.numel() for p in make_tiny_net().parameters())
HEADER_ONLY = frame_bytes(PS_WIRE.header.size, 0)  # a frame without payload, on the wire
STEPS = 2 * 7  # 2 epochs of the largest partition's 56 rows in batches of 8


def test_four_workers_on_two_executors_aggregate_per_executor_and_match_the_flat_runs(tmp_path):
    result = run_drill("hierarchy_drill.py", tmp_path)
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
