"""Parked pulls on and off in one run (issue 13, item 4): the strategies benchmark's
synchronous parameter server through shared memory, with the server's pulls parked (the
default) and with every pull waiting on its connection's thread (``PARK_MAX_VALUES = 0``,
the old way), alternated after an all-reduce run; samples/s of epochs 2+ against it.

    .venv/bin/python benchmarks/bench_parked_pulls.py [--repeats 2]

The server runs in this (the driver's) process, so the constant is switched here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_strategies import add_workload_arguments, run_variant  # noqa: E402
from common import save_report  # noqa: E402
from spark_setup import bench_session, dataframe  # noqa: E402

from sparkdl.services.ps import server  # noqa: E402

SYNC_PS = {"strategy": "parameter_server", "ps_mode": "sync"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_workload_arguments(parser)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", default=str(HERE / "results/parked_pulls.json"))
    args = parser.parse_args()
    spark = bench_session("sparkdl-bench-parked-pulls")
    train_df, test_df = dataframe(spark, args.rows, 2, seed=0), dataframe(spark, args.test_rows, 2, seed=1)
    base = run_variant(train_df, test_df, {"strategy": "allreduce"}, args.epochs, args.batch_size)
    parked_limit = server.PARK_MAX_VALUES
    runs: dict[str, list[dict]] = {"parked": [], "waiting": []}
    for repeat in range(args.repeats):
        order = ["parked", "waiting"] if repeat % 2 == 0 else ["waiting", "parked"]
        for way in order:
            server.PARK_MAX_VALUES = parked_limit if way == "parked" else 0
            result = run_variant(train_df, test_df, SYNC_PS, args.epochs, args.batch_size)
            result["samples_per_s_vs_allreduce"] = (
                result["samples_per_s_epochs_2plus"] / base["samples_per_s_epochs_2plus"]
            )
            runs[way].append(result)
            print(way, round(result["samples_per_s_vs_allreduce"], 3), flush=True)
    server.PARK_MAX_VALUES = parked_limit
    save_report(
        args.output,
        setup={"rows": args.rows, "epochs": args.epochs, "batch_size_per_worker": args.batch_size},
        results={"allreduce": base, **runs},
    )
    spark.stop()


if __name__ == "__main__":
    main()
