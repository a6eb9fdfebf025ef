"""Hierarchical aggregation on local-cluster: 2 executors x 2 task slots = 4 workers on 2
"hosts" (``runtime.hierarchy = "executor"``), against the flat runs.

Run on :mod:`tests.spark.local_cluster_drill`'s cluster (its executors' fake GPUs are not
asked for: ``use_gpu = false``).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.reference import make_shards, max_abs_diff
from tests.spark.test_fit import estimator, shards_dataframe

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


def run(spark: Any) -> dict[str, Any]:
    """Every run of :data:`RUNS` on 4 workers of ``spark``'s 2 executors: the bytes each rank
    sent across executors, its devices, and its weights' distance to the flat all-reduce's."""
    df = shards_dataframe(spark, make_shards([48, 40, 56, 32]))
    models = {}
    result: dict[str, Any] = {}
    for name, settings in RUNS.items():
        model = estimator(num_workers=4, epochs=2, optimizer_fn=_plain_sgd, use_gpu="false", **settings).fit(
            df
        )
        models[name] = model
        result[name] = {
            "across": [sum(h["worker_bytes_across_hosts"][r] for h in model.history) for r in range(4)],
            "devices": model.worker_devices,
        }
    reference = models["allreduce flat"].module.state_dict()
    for name, model in models.items():
        result[name]["max_abs_diff"] = max_abs_diff(reference, model.module.state_dict())
    return result
