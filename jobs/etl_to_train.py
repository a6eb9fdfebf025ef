"""ETL to training: raw CSV/Parquet -> Spark SQL feature steps -> fit -> predictions as Parquet.

spark-submit jobs/etl_to_train.py --config conf/etl.toml [--set section.key=value ...] [--output DIR]
python jobs/etl_to_train.py --config conf/etl.toml          # local embedded Spark
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparkdl.errors import SparkDLError
from sparkdl.etl import load_etl_config, run_etl_job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="conf/etl.toml", help="TOML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting (repeatable), e.g. --set etl.input_path=/data/raw.parquet",
    )
    parser.add_argument(
        "--output", default="out/etl", help="directory for predictions/, pipeline/, metrics.json"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    try:
        config = load_etl_config(args.config, args.overrides)
        metrics = run_etl_job(config, args.output)
    except SparkDLError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        json.dumps(
            {k: metrics[k] for k in ("test_accuracy", "test_rows", "classes", "fit_seconds")}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
