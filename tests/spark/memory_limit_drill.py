"""Drill: a model whose training state is larger than one worker's memory limit trains as a
pipeline of 4 stages under that limit (issue 33); with ``allreduce``, all-reduce then fails
under it (4 workers of 2.6 GB each: not beside other tests).

``spark.executor.pyspark.memory`` is what Spark gives each Python worker: PySpark's worker
sets it as the process's address-space limit (``RLIMIT_AS``) before each task. The model
(Adam, fp32) needs 16 bytes of training state per parameter (weights, gradients, two
moments): more than the limit in all. A stage holds a quarter of it; rank 0 also holds the
whole model's weights once, at the end, to send them to the driver.

Run by tests/spark/test_large_model.py in its own process (the limit is fixed when the
SparkContext starts): python tests/spark/memory_limit_drill.py OUT_DIR [LIMIT_MB [allreduce]]
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sparkdl import TorchEstimator  # noqa: E402
from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.errors import SparkDLError  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402

WIDTH, DEPTH = 4096, 12  # 12 Linear(4096, 4096): 201M parameters, 805 MB of weights
FEATURES = 16
LIMIT_MB = 2600  # below the 3.2 GB of training state; above a stage's share and rank 0's end


def make_wide_net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(FEATURES, WIDTH)]
    for _ in range(DEPTH):
        layers += [torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH)]
    return torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(WIDTH, 2))


def adam(params):
    return torch.optim.Adam(params, lr=1e-4)


def address_space_limit(_: int) -> int:
    return resource.getrlimit(resource.RLIMIT_AS)[0]


def main(out: Path, limit_mb: int, allreduce: bool = False) -> None:
    session = build_session(
        "local[4]",
        "sparkdl-memory-limit-drill",
        SparkDLConfig(),
        {
            "spark.executor.pyspark.memory": f"{limit_mb}m",
            "spark.ui.enabled": "false",
            "spark.driver.host": "127.0.0.1",
        },
    )
    session.sparkContext.setLogLevel("ERROR")
    sc = session.sparkContext
    limits = sc.parallelize(range(4), 4).map(address_space_limit).collect()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, FEATURES)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    rows = [(x[i].tolist(), int(y[i])) for i in range(len(y))]
    df = session.createDataFrame(rows, "features array<float>, label long").repartition(4).cache()
    df.count()

    def estimator(**settings):
        base = dict(
            model_fn=make_wide_net, optimizer_fn=adam, loss_fn="cross_entropy", feature_cols=["features"],
            num_workers=4, batch_size=4, epochs=1, shuffle=False, collective_timeout_s=120.0,
        )  # fmt: skip
        return TorchEstimator(**{**base, **settings})

    started = time.perf_counter()
    model = estimator(strategy="pipeline", microbatches=4).fit(df)
    fit_s = time.perf_counter() - started
    params = sum(p.numel() for p in model.module.parameters())
    start = make_wide_net()
    moved = (model.module[2].weight - start[2].weight).abs().max().item()

    started = time.perf_counter()
    allreduce_error = "not run"
    try:
        if allreduce:
            estimator(strategy="allreduce").fit(df)
            allreduce_error = ""
    except SparkDLError as exc:
        allreduce_error = f"{type(exc).__name__}: {exc}"
    allreduce_s = time.perf_counter() - started

    result = {
        "limit_bytes": limit_mb * 2**20,
        "worker_limits": limits,
        "parameters": params,
        "state_bytes": 16 * params,
        "history": model.history,
        "moved": moved,
        "fit_s": fit_s,
        "allreduce_error": allreduce_error,
        "allreduce_s": allreduce_s,
    }
    (out / "result.json").write_text(json.dumps(result, default=str))
    session.stop()


if __name__ == "__main__":
    limit_mb = int(sys.argv[2]) if len(sys.argv) > 2 else LIMIT_MB
    main(Path(sys.argv[1]), limit_mb, sys.argv[3:] == ["allreduce"])
