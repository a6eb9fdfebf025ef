"""Drill: the asynchronous parameter server in ordinary tasks (``ps_barrier = false``); one
task's Python dies mid-epoch and Spark retries it alone.

``local[3, 4]`` (3 slots, 4 attempts per task). Two fits of 3 workers, 2 epochs each, on
a learnable problem (labels: the argmax of a fixed linear map): one undisturbed, one where
partition 1's first attempt exits (``os._exit``) at its 6th step, the driver snapshotting
the server in ``checkpoint_dir``; then a third fit of one epoch more on that directory, which
resumes from the snapshot; then the killed fit again under ``ps_mode = "ssp"`` (staleness 1).
Writes each fit's history (the server's per-partition rows and
push gaps, the takeovers) and held-out accuracy.

Run by tests/spark/test_independent_ps.py in its own process:
python tests/spark/independent_ps_drill.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sparkdl import TorchEstimator  # noqa: E402
from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402

ROWS, WIDTH, CLASSES, EPOCHS = 120, 6, 3, 2
DIE_AT_STEP = 6
STEP_S = 0.03  # each forward sleeps this long: the others are mid-epoch while the retry starts


class Net(nn.Module):
    """A linear classifier whose forward sleeps; with ``die`` partition 1's first task
    attempt exits its Python worker at its ``DIE_AT_STEP``-th training forward."""

    def __init__(self, die: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, CLASSES)
        self.die = die
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            time.sleep(STEP_S)
            if self.die and self.calls == DIE_AT_STEP:
                from pyspark import TaskContext

                ctx = TaskContext.get()
                if ctx is not None and ctx.partitionId() == 1 and ctx.attemptNumber() == 0:
                    os._exit(3)  # the task's Python dies: no error record, no goodbye
        return self.linear(x)


def problem(seed: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    weights = np.random.default_rng(0).normal(size=(WIDTH, CLASSES))
    x = np.random.default_rng(seed).normal(size=(rows, WIDTH)).astype(np.float32)
    return x, np.argmax(x @ weights, axis=1).astype(np.int64)


def downpour(model_fn, num_workers: int, epochs: int, **settings) -> TorchEstimator:
    """The drills' estimator: the asynchronous parameter server in ordinary tasks, batches
    of 8, SGD at 0.2 on the server; ``settings`` on top."""
    base = dict(
        model_fn=model_fn, loss_fn="cross_entropy", feature_cols=["features"], label_col="label",
        num_workers=num_workers, batch_size=8, epochs=epochs, seed=0, lr=0.2,
        strategy="parameter_server", ps_mode="async", ps_barrier=False, ps_timeout_s=30.0,
        progress=False, preflight=False,
    )  # fmt: skip
    return TorchEstimator(**{**base, **settings})


def fit(spark, df, die: bool, held_out, epochs: int = EPOCHS, **settings) -> dict:
    started = time.monotonic()
    model = downpour(lambda: Net(die), 3, epochs, **settings).fit(df)
    seconds = time.monotonic() - started
    x, y = held_out
    with torch.no_grad():
        module = model.module.eval()
        accuracy = float((module(torch.from_numpy(x)).argmax(1).numpy() == y).mean())
    return {"seconds": seconds, "accuracy": accuracy, "history": model.history, "rows": model.worker_rows}


def main(out: Path) -> None:
    spark = build_session(
        "local[3, 4]",
        "sparkdl-independent-ps",
        SparkDLConfig(),
        {
            "spark.ui.enabled": "false",
            "spark.driver.host": "127.0.0.1",
            "spark.python.daemon.module": "sparkdl.spark.daemon",
        },
    )
    spark.sparkContext.setLogLevel("ERROR")
    from pyspark.sql import Row

    parts = [problem(seed, ROWS) for seed in (1, 2, 3)]
    rows = [[Row(features=[float(v) for v in x[i]], label=int(y[i])) for i in range(ROWS)] for x, y in parts]
    rdd = spark.sparkContext.parallelize(range(3), 3).flatMap(lambda i: rows[i])
    df = spark.createDataFrame(rdd, "features array<float>, label long").cache()
    df.count()
    held_out = problem(9, 600)
    snapshots = {"checkpoint_dir": str(out / "server"), "checkpoint_every": 5}
    result = {
        "undisturbed": fit(spark, df, False, held_out),
        "killed": fit(spark, df, True, held_out, **snapshots),
        # a new fit on the killed one's checkpoint_dir, one epoch more: the driver's snapshot of
        # the server brings back its weights and each partition's rows; only the new epoch trains
        "resumed": fit(spark, df, False, held_out, epochs=EPOCHS + 1, **snapshots),
        # stale-synchronous, the same task killed: a pull waits while its partition is a push
        # ahead of the slowest live one, and the dead task holds nobody back
        "ssp killed": fit(spark, df, True, held_out, ps_mode="ssp", staleness=1),
    }
    spark.stop()
    (out / "result.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
