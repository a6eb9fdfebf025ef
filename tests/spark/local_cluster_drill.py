"""Drills whose workers need executors in their own JVMs, on one local-cluster of 2 executors
x 2 slots, each executor holding a fake GPU "0" from a discovery script (no CUDA needed):

- stage-level GPU scheduling (:mod:`tests.spark.gpu_profile_drill`): ETL stages hold no GPU,
  the training stage one per task (so one task per executor);
- hierarchical aggregation (:mod:`tests.spark.hierarchy_drill`): 4 workers on the 2
  executors, asking for no GPU.

One cluster for both: its start (a driver and two executor JVMs, a Python daemon each) costs
more CPU than either drill's fits.

Run by tests/spark/test_local_cluster.py in its own process (one SparkContext per process):
python tests/spark/local_cluster_drill.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402
from tests.spark import gpu_profile_drill, hierarchy_drill  # noqa: E402


def main(out: Path) -> None:
    spark = build_session(
        "local-cluster[2,2,1024]",
        "sparkdl-local-cluster-drills",
        SparkDLConfig().replace(collective_timeout_s=60.0),
        {
            "spark.ui.enabled": "false",
            "spark.driver.host": "127.0.0.1",
            **gpu_profile_drill.gpu_settings(out, 1, real=False),
        },
    )
    spark.sparkContext.setLogLevel("ERROR")
    result = {"gpu": gpu_profile_drill.run(spark, workers=2), "hierarchy": hierarchy_drill.run(spark)}
    (out / "result.json").write_text(json.dumps(result))
    spark.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
