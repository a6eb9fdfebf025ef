"""The strategy advisor against the strategies benchmark (issue 15, item 4): in one session,
``sparkdl.advise`` probes the cluster, then every variant of bench_strategies.py trains for
real (twice, in alternating order: the mean); each row's predicted samples/s (epochs 2+) is
compared with the measured one.

    .venv/bin/python benchmarks/bench_advisor.py [--rows 200000] [--epochs 4] [--link loopback]
    ../shared/tools/slow-net --rate 1gbit -- .venv/bin/python benchmarks/bench_advisor.py --link 1gbit
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # spark_setup sets the environment and puts sparkdl on the path

from bench_strategies import (  # noqa: E402
    VARIANTS,
    add_workload_arguments,
    run_variant,
    strategies_estimator,
)
from common import save_report  # noqa: E402
from spark_setup import bench_session, dataframe  # noqa: E402

from sparkdl import advise  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_workload_arguments(parser)
    parser.add_argument("--steps", type=int, default=64, help="the probe's batches per worker")
    parser.add_argument(
        "--repeats", type=int, default=2, help="fits of each variant, in alternating order (mean)"
    )
    parser.add_argument("--link", default="loopback", help="a label for the results file")
    parser.add_argument("--only", default="", help="comma-separated variant names to train for real")
    args = parser.parse_args()
    spark = bench_session("sparkdl-bench-advisor")
    train_df, test_df = dataframe(spark, args.rows, 2, seed=0), dataframe(spark, args.test_rows, 2, seed=1)
    estimator = strategies_estimator(args.epochs, args.batch_size)
    started = time.perf_counter()
    advice = advise(train_df, estimator, steps=args.steps, project_to=(8, 32, 128))
    probe_s = time.perf_counter() - started
    print(advice)
    wanted = set(filter(None, args.only.split(",")))
    variants = [(name, settings) for name, settings in VARIANTS if not wanted or name in wanted]
    runs: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for repeat in range(args.repeats):  # forward, then backward: a drifting machine favours none
        for name, settings in variants if repeat % 2 == 0 else variants[::-1]:
            runs[name].append(run_variant(train_df, test_df, settings, args.epochs, args.batch_size))
    rows = {}
    for name, _ in variants:
        measured = sum(r["samples_per_s_epochs_2plus"] for r in runs[name]) / len(runs[name])
        predicted = advice.prediction(name)
        rows[name] = {
            "predicted_samples_per_s": predicted.samples_per_s,
            "measured_samples_per_s": measured,
            "predicted_over_measured": predicted.samples_per_s / measured,
            "source": predicted.source,
            "measured": runs[name],
        }
        print(
            f"{name:<44} predicted {predicted.samples_per_s:>10,.0f}  measured {measured:>10,.0f}  "
            f"ratio {rows[name]['predicted_over_measured']:.2f}",
            flush=True,
        )
    save_report(
        str(HERE / f"results/advisor_{args.link}.json"),
        setup={
            "rows": args.rows,
            "epochs": args.epochs,
            "batch_size_per_worker": args.batch_size,
            "workers": 2,
            "probe_steps": args.steps,
            "repeats": args.repeats,
            "link": args.link,
            "probe_seconds": probe_s,
        },
        advice=advice.to_dict(),
        rows=rows,
    )
    spark.stop()


if __name__ == "__main__":
    main()
