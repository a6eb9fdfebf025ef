"""Stage-level GPU scheduling on local-cluster, with fake GPUs or the machine's real ones.

fake: :mod:`tests.spark.local_cluster_drill`'s two executors, each with one GPU "0" from a
discovery script (no CUDA needed).
real: one worker holding every CUDA device (up to 2) from an nvidia-smi discovery script,
one training task per GPU, NCCL. Run by tests/spark/test_gpu_scheduling.py in its own
process (one SparkContext per process): python tests/spark/gpu_profile_drill.py OUT_DIR
"""

from __future__ import annotations

import json
import logging
import stat
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402
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


FAKE = '#!/usr/bin/env bash\necho \'{"name": "gpu", "addresses": ["0"]}\'\n'
REAL = (
    "#!/usr/bin/env bash\n"
    "ids=$(nvidia-smi --query-gpu=index --format=csv,noheader | head -n {n}"
    " | sed 's/.*/\"&\"/' | paste -sd, -)\n"
    'echo "{{\\"name\\": \\"gpu\\", \\"addresses\\": [$ids]}}"\n'
)


def gpu_settings(out: Path, gpus: int, real: bool) -> dict[str, str]:
    """A session's settings for workers of ``gpus`` GPUs each, found by a discovery script
    written to ``out``: the machine's first ``gpus`` CUDA devices, or one fake GPU "0". Each
    worker gives them to its executor; no task-level GPU amount: only the training stage
    asks for one."""
    script = out / "gpus.sh"
    script.write_text(REAL.format(n=gpus) if real else FAKE)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {
        "spark.worker.resource.gpu.amount": str(gpus),
        "spark.worker.resource.gpu.discoveryScript": str(script),
        "spark.executor.resource.gpu.amount": str(gpus),
    }


def run(spark: Any, workers: int) -> dict[str, Any]:
    """An ETL stage, fits of ``workers`` workers with ``use_gpu`` "auto" and "false", and an
    ETL stage again: which GPUs each stage's tasks held, the workers' devices, weights and
    forwarded warnings."""
    results: dict[str, Any] = {}
    forwarded: list[str] = []
    collect = logging.Handler(logging.WARNING)
    collect.emit = lambda record: forwarded.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("sparkdl.worker").addHandler(collect)
    try:
        etl = spark.range(4, numPartitions=2).mapInArrow(record_resources, "gpus string").collect()
        results["etl_stage_gpus"] = [json.loads(r.gpus) for r in etl]
        df = shards_dataframe(spark, make_shards([64] * workers))
        for use_gpu in ("auto", "false"):
            model = estimator(
                use_gpu=use_gpu, num_workers=workers, executor_wait_timeout_s=120.0, progress=False
            ).fit(df)
            results[use_gpu] = model.worker_devices
            results[f"{use_gpu}_state"] = {k: v.tolist() for k, v in model.module.state_dict().items()}
        results["etl_after_fit_gpus"] = [
            json.loads(r.gpus)
            for r in spark.range(4, numPartitions=2).mapInArrow(record_resources, "gpus string").collect()
        ]
    finally:
        logging.getLogger("sparkdl.worker").removeHandler(collect)
    results["worker_warnings"] = forwarded
    return results


def main(out: Path) -> None:
    """The machine's real GPUs (up to 2) on one worker: one training task per GPU, NCCL."""
    import torch

    gpus = min(torch.cuda.device_count(), 2)
    spark = build_session(
        f"local-cluster[1,{gpus},4096]",
        "sparkdl-gpu-profile",
        SparkDLConfig().replace(collective_timeout_s=60.0),
        {"spark.ui.enabled": "false", "spark.driver.host": "127.0.0.1", **gpu_settings(out, gpus, real=True)},
    )
    spark.sparkContext.setLogLevel("ERROR")
    (out / "result.json").write_text(json.dumps(run(spark, gpus)))
    spark.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
