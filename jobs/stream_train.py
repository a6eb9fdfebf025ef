"""Streaming job: Parquet files landing in a directory -> a model version per micro-batch.

spark-submit jobs/stream_train.py --config conf/stream.toml [--set section.key=value ...] [--output DIR]
.venv/bin/python jobs/stream_train.py --config conf/stream.toml          # local embedded Spark
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparkdl.apps.stream_job import STREAM_EPILOG, load_stream_config, run_stream_job
from sparkdl.apps.train_job import job_main


def main(argv: list[str] | None = None) -> int:
    return job_main(
        argv,
        __doc__,
        ("conf/stream.toml", "out/stream"),
        load_stream_config,
        run_stream_job,
        ("batches_trained", "batches_skipped", "latest_batch_id", "latest_version", "seconds"),
        epilog=STREAM_EPILOG,
    )


if __name__ == "__main__":
    sys.exit(main())
