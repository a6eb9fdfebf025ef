"""Main job: train on a bundled data set and write metrics and the model.

spark-submit jobs/train.py --config conf/local.toml [--set section.key=value ...] [--output DIR]
python jobs/train.py --config conf/local.toml          # local embedded Spark
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparkdl.errors import SparkDLError
from sparkdl.job import load_job_config, run_train_job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="conf/local.toml", help="TOML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting (repeatable), e.g. --set training.epochs=3",
    )
    parser.add_argument("--output", default="out/train", help="directory for metrics.json and model/")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    try:
        config = load_job_config(args.config, args.overrides)
        metrics = run_train_job(config, args.output)
    except SparkDLError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = {
        k: metrics[k] for k in ("test_accuracy", "final_loss", "fit_seconds", "train_rows", "test_rows")
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
