"""Hierarchical aggregation on local-cluster: 2 executors x 2 task slots = 4 workers on 2
"hosts" (``runtime.hierarchy = "executor"``), against the flat runs.

Run by tests/spark/test_cluster_faults.py in its own process (one SparkContext per
process): python tests/spark/hierarchy_drill.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402
from tests.reference import make_shards, max_abs_diff  # noqa: E402
from tests.spark.test_fit import estimator, shards_dataframe  # noqa: E402

RUNS = {
    "allreduce flat": {"strategy": "allreduce"},
    "allreduce executor": {"strategy": "allreduce", "hierarchy": "executor"},
    "weight_averaging executor": {"strategy": "weight_averaging", "sync_every": 1, "hierarchy": "executor"},
    # the executors stand for hosts: these parameter-server runs keep their sockets, so that
    # what they count is what would cross the network (ps_shared_memory_mb = 0) ...
    "parameter_server flat": {"strategy": "parameter_server", "ps_mode": "sync", "ps_shared_memory_mb": 0.0},
    "parameter_server executor": {
        "strategy": "parameter_server",
        "ps_mode": "sync",
        "hierarchy": "executor",
        "ps_shared_memory_mb": 0.0,
    },
    # ... and this one, as on one real host, pushes and pulls through the driver's shared memory
    "parameter_server shared memory": {"strategy": "parameter_server", "ps_mode": "sync"},
}


def _plain_sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def main(out: Path) -> None:
    spark = build_session(
        "local-cluster[2,2,1024]",
        "sparkdl-hierarchy",
        SparkDLConfig().replace(collective_timeout_s=30.0),
        {"spark.ui.enabled": "false", "spark.driver.host": "127.0.0.1"},
    )
    spark.sparkContext.setLogLevel("ERROR")
    shards = make_shards([48, 40, 56, 32])
    df = shards_dataframe(spark, shards)
    models = {}
    result = {}
    for name, settings in RUNS.items():
        model = estimator(num_workers=4, epochs=2, optimizer_fn=_plain_sgd, **settings).fit(df)
        models[name] = model
        result[name] = {
            "across": [sum(h["worker_bytes_across_hosts"][r] for h in model.history) for r in range(4)],
            "devices": model.worker_devices,
        }
    reference = models["allreduce flat"].module.state_dict()
    for name, model in models.items():
        result[name]["max_abs_diff"] = max_abs_diff(reference, model.module.state_dict())
    (out / "result.json").write_text(json.dumps(result))
    spark.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
