"""ETL to training: raw CSV/Parquet -> Spark SQL feature steps -> fit -> predictions as Parquet.

spark-submit jobs/etl_to_train.py --config conf/etl.toml [--set section.key=value ...] [--output DIR]
.venv/bin/python jobs/etl_to_train.py --config conf/etl.toml          # local embedded Spark
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparkdl.apps.etl_job import ETL_EPILOG, load_etl_config, run_etl_job
from sparkdl.apps.train_job import job_main


def main(argv: list[str] | None = None) -> int:
    return job_main(
        argv,
        __doc__,
        ("conf/etl.toml", "out/etl"),
        load_etl_config,
        run_etl_job,
        ("test_accuracy", "test_rows", "classes", "fit_seconds"),
        epilog=ETL_EPILOG,
    )


if __name__ == "__main__":
    sys.exit(main())
