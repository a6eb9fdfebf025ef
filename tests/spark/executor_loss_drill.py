"""Drill: kill an executor JVM mid-training on local-cluster, resume, compare with a clean run.

Run by tests/spark/test_cluster_faults.py in its own process (one SparkContext per
process): python tests/spark/executor_loss_drill.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402
from tests.reference import make_shards, max_abs_diff  # noqa: E402
from tests.spark.test_fit import estimator, shards_dataframe  # noqa: E402


def main(out: Path) -> None:
    spark = build_session(
        "local-cluster[2,1,1024]",
        "sparkdl-executor-loss",
        SparkDLConfig().replace(collective_timeout_s=20.0),
        {"spark.ui.enabled": "false", "spark.driver.host": "127.0.0.1"},
    )
    spark.sparkContext.setLogLevel("ERROR")
    shards = make_shards([96, 96])
    runs = {}
    for name, drill in (("clean", ""), ("drilled", f"killjvm:1:10:{out / 'fired'}")):
        est = estimator(
            epochs=2,
            shuffle=True,
            checkpoint_dir=str(out / name),
            checkpoint_every=4,
            fault_injection=drill,
            executor_wait_timeout_s=120.0,
            collective_timeout_s=20.0,
        )
        started = time.monotonic()
        model = est.fit(shards_dataframe(spark, shards))
        runs[name] = (model, time.monotonic() - started)
    clean, drilled = runs["clean"][0], runs["drilled"][0]
    resumed = [h for h in drilled.history if "resumed_from_step" in h]
    result = {
        "fired": (out / "fired").exists(),
        "max_abs_diff": max_abs_diff(clean.module.state_dict(), drilled.module.state_dict()),
        "resumed": resumed[0] if resumed else None,
        "clean_s": runs["clean"][1],
        "drilled_s": runs["drilled"][1],
    }
    (out / "result.json").write_text(json.dumps(result))
    spark.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
