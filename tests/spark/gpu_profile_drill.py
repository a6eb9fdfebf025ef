"""Stage-level GPU scheduling on local-cluster with fake GPUs (a discovery script).

Run by tests/spark/test_gpu_scheduling.py in its own process (one SparkContext per
process): python tests/spark/gpu_profile_drill.py OUT_DIR
"""

from __future__ import annotations

import json
import logging
import stat
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.runtime.session import build_session  # noqa: E402
from tests.reference import make_shards  # noqa: E402
from tests.spark.test_fit import estimator, shards_dataframe  # noqa: E402


def record_resources(batches):
    """An ordinary (ETL) stage: which resources did its task get?"""
    import pyarrow as pa
    from pyspark import TaskContext

    for _ in batches:
        pass
    gpus = TaskContext.get().resources().get("gpu")
    yield pa.RecordBatch.from_pydict({"gpus": [json.dumps(list(gpus.addresses) if gpus else [])]})


def main(out: Path) -> None:
    script = out / "fake_gpus.sh"
    script.write_text('#!/usr/bin/env bash\necho \'{"name": "gpu", "addresses": ["0"]}\'\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    spark = build_session(
        "local-cluster[2,1,1024]",
        "sparkdl-gpu-profile",
        SparkDLConfig().replace(collective_timeout_s=60.0),
        {
            "spark.ui.enabled": "false",
            "spark.driver.host": "127.0.0.1",
            # each worker has one (fake) GPU and gives it to its executor; no task-level
            # GPU amount: only the training stage asks for one
            "spark.worker.resource.gpu.amount": "1",
            "spark.worker.resource.gpu.discoveryScript": str(script),
            "spark.executor.resource.gpu.amount": "1",
        },
    )
    spark.sparkContext.setLogLevel("ERROR")
    results: dict = {}
    forwarded: list[str] = []
    collect = logging.Handler(logging.WARNING)
    collect.emit = lambda record: forwarded.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("sparkdl.worker").addHandler(collect)
    etl = spark.range(4, numPartitions=2).mapInArrow(record_resources, "gpus string").collect()
    results["etl_stage_gpus"] = [json.loads(r.gpus) for r in etl]
    df = shards_dataframe(spark, make_shards([64, 64]))
    for use_gpu in ("auto", "false"):
        model = estimator(use_gpu=use_gpu, executor_wait_timeout_s=120.0, progress=False).fit(df)
        results[use_gpu] = model.worker_devices
    results["etl_after_fit_gpus"] = [
        json.loads(r.gpus)
        for r in spark.range(4, numPartitions=2).mapInArrow(record_resources, "gpus string").collect()
    ]
    results["worker_warnings"] = forwarded
    (out / "result.json").write_text(json.dumps(results))
    spark.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
