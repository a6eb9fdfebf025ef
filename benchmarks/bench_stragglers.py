"""Stragglers (issue 15, item 3): one worker of two made three times slower by the ``slow``
fault drill, under the parameter server's synchronous mode, synchronous with one backup
worker, SSP and async, under weight averaging (tau 4) with and without one backup worker,
and with no drill for reference; the same data, model and epochs in one run. Epoch time
(the first epoch streams from Spark in lockstep, so epochs 2+ are what a mode changes),
held-out accuracy, and what the slow rank skipped.

    .venv/bin/python benchmarks/bench_stragglers.py [--rows 40000] [--epochs 3] [--only "sync,..."]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # spark_setup sets the environment and puts sparkdl on the path

from common import make_model, save_report  # noqa: E402
from spark_setup import bench_session, dataframe  # noqa: E402

from sparkdl import TorchEstimator  # noqa: E402

SLOW = "slow:1:0:"
VARIANTS = [
    ("sync, no straggler", {"ps_mode": "sync"}),
    ("sync", {"ps_mode": "sync", "fault_injection": SLOW}),
    ("sync, 1 backup worker", {"ps_mode": "sync", "backup_workers": 1, "fault_injection": SLOW}),
    ("ssp s=2", {"ps_mode": "ssp", "staleness": 2, "fault_injection": SLOW}),
    ("async", {"ps_mode": "async", "fault_injection": SLOW}),
    ("weight_averaging tau=4, no straggler", {"strategy": "weight_averaging", "sync_every": 4}),
    ("weight_averaging tau=4", {"strategy": "weight_averaging", "sync_every": 4, "fault_injection": SLOW}),
    (
        "weight_averaging tau=4, 1 backup worker",
        {"strategy": "weight_averaging", "sync_every": 4, "wa_backup_workers": 1, "fault_injection": SLOW},
    ),
]


def run_variant(train_df, test_df, settings: dict, epochs: int, batch_size: int) -> dict:
    estimator = TorchEstimator(
        model_fn=make_model,
        feature_cols=["features"],
        num_workers=2,
        batch_size=batch_size,
        epochs=epochs,
        seed=0,
        optimizer="sgd",
        lr=0.05,
        **{"strategy": "parameter_server", **settings},
    )
    model = estimator.fit(train_df)
    rows = model.transform(test_df).select("label", "prediction").collect()
    later = model.history[1:]
    return {
        "epoch_s": [h["seconds"] for h in model.history],
        "epoch_s_2plus_mean": sum(h["seconds"] for h in later) / len(later),
        "test_accuracy": sum(int(r[0] == r[1]) for r in rows) / len(rows),
        "trained_samples": [h["samples"] for h in model.history],
        "skipped_steps": [h["skipped_steps"] for h in model.history],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=40_000)
    parser.add_argument("--test-rows", type=int, default=10_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--output", default=str(HERE / "results/stragglers.json"))
    parser.add_argument("--only", default="", help="comma-separated variant names (sync always runs)")
    args = parser.parse_args()
    wanted = {"sync", *filter(None, args.only.split(","))}
    spark = bench_session("sparkdl-bench-stragglers")
    train_df, test_df = dataframe(spark, args.rows, 2, seed=0), dataframe(spark, args.test_rows, 2, seed=1)
    results = {}
    for name, settings in VARIANTS:
        if args.only and name not in wanted:
            continue
        results[name] = run_variant(train_df, test_df, settings, args.epochs, args.batch_size)
        print(name, results[name], flush=True)
    base = results["sync"]["epoch_s_2plus_mean"]
    for result in results.values():
        result["epoch_s_2plus_vs_sync"] = result["epoch_s_2plus_mean"] / base
    save_report(
        args.output,
        setup={
            "rows": args.rows,
            "epochs": args.epochs,
            "batch_size_per_worker": args.batch_size,
            "workers": 2,
            "drill": SLOW + " (rank 1 three times slower from step 0)",
        },
        results=results,
    )
    spark.stop()


if __name__ == "__main__":
    main()
