"""Main job: train on a bundled data set and write metrics and the model.

spark-submit jobs/train.py --config conf/local.toml [--set section.key=value ...] [--output DIR]
.venv/bin/python jobs/train.py --config conf/local.toml          # local embedded Spark
.venv/bin/python jobs/train.py --config conf/local.toml --advise # predicted samples/s of every strategy
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparkdl.apps.train_job import TRAIN_EPILOG, job_main, load_job_config, run_advise_job, run_train_job


def main(argv: list[str] | None = None) -> int:
    return job_main(
        argv,
        __doc__,
        ("conf/local.toml", "out/train"),
        load_job_config,
        run_train_job,
        ("test_accuracy", "final_loss", "fit_seconds", "train_rows", "test_rows"),
        advise=run_advise_job,
        epilog=TRAIN_EPILOG,
    )


if __name__ == "__main__":
    sys.exit(main())
