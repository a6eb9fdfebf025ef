"""Sync strategies compared in one run (issue 3 item 6, issue 4 item 9): samples/s, bytes sent per worker
and held-out accuracy after the same number of epochs, on the same model and data.

    .venv/bin/python benchmarks/bench_strategies.py [--rows 200000] [--epochs 4] [--only fsdp,...]
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

VARIANTS = [
    ("allreduce", {"strategy": "allreduce"}),  # one host: through shared memory (the default)
    ("allreduce over gloo", {"strategy": "allreduce", "shared_memory": False}),
    ("weight_averaging tau=1", {"strategy": "weight_averaging", "sync_every": 1}),
    ("weight_averaging tau=4", {"strategy": "weight_averaging", "sync_every": 4}),
    ("weight_averaging tau=16", {"strategy": "weight_averaging", "sync_every": 16}),
    ("parameter_server sync", {"strategy": "parameter_server", "ps_mode": "sync"}),  # shared memory
    (
        "parameter_server sync over sockets",
        {"strategy": "parameter_server", "ps_mode": "sync", "ps_shared_memory_mb": 0.0},
    ),
    ("parameter_server ssp s=2", {"strategy": "parameter_server", "ps_mode": "ssp", "staleness": 2}),
    ("parameter_server async", {"strategy": "parameter_server", "ps_mode": "async"}),
    (
        "parameter_server async push/pull every 4",
        {"strategy": "parameter_server", "ps_mode": "async", "push_every": 4, "pull_every": 4},
    ),
    ("fsdp", {"strategy": "fsdp"}),
]


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The strategies benchmark's workload on the command line (the advisor's benchmark too)."""
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--test-rows", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128)


def strategies_estimator(epochs: int, batch_size: int, **settings) -> TorchEstimator:
    """The estimator every variant fits (and the advisor benchmark probes): settings on top."""
    return TorchEstimator(
        model_fn=make_model,
        feature_cols=["features"],
        num_workers=2,
        batch_size=batch_size,
        epochs=epochs,
        seed=0,
        optimizer="sgd",
        lr=0.05,
        momentum=0.0,
        progress=False,  # no bars in the benchmark's log (the channel still runs: heartbeats, figures)
        **settings,
    )


def run_variant(train_df, test_df, settings: dict, epochs: int, batch_size: int) -> dict:
    model = strategies_estimator(epochs, batch_size, **settings).fit(train_df)
    later = model.history[1:]
    rows = model.transform(test_df).select("label", "prediction").collect()
    samples = sum(h["samples"] for h in model.history)
    return {
        "samples_per_s_epochs_2plus": sum(h["samples"] for h in later) / sum(h["seconds"] for h in later),
        "sync_rounds": sum(h["sync_rounds"] for h in model.history),
        "bytes_sent_per_worker": sum(h["bytes_sent"] for h in model.history),
        "bytes_per_sample": sum(h["bytes_sent"] for h in model.history) / samples,
        "final_loss": model.history[-1]["loss"],
        "test_accuracy": sum(int(r[0] == r[1]) for r in rows) / len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_workload_arguments(parser)
    parser.add_argument("--output", default=str(HERE / "results/strategies.json"))
    parser.add_argument("--only", default="", help="comma-separated variant names (allreduce always runs)")
    args = parser.parse_args()
    wanted = {"allreduce", *filter(None, args.only.split(","))}
    variants = [(name, s) for name, s in VARIANTS if not args.only or name in wanted]
    spark = bench_session("sparkdl-bench-strategies")
    train_df, test_df = dataframe(spark, args.rows, 2, seed=0), dataframe(spark, args.test_rows, 2, seed=1)
    results = {name: run_variant(train_df, test_df, s, args.epochs, args.batch_size) for name, s in variants}
    base = results["allreduce"]
    for result in results.values():
        result["samples_per_s_vs_allreduce"] = (
            result["samples_per_s_epochs_2plus"] / base["samples_per_s_epochs_2plus"]
        )
        result["bytes_per_sample_vs_allreduce"] = result["bytes_per_sample"] / base["bytes_per_sample"]
    save_report(
        args.output,
        setup={
            "rows": args.rows,
            "epochs": args.epochs,
            "batch_size_per_worker": args.batch_size,
            "workers": 2,
            "optimizer": "SGD lr=0.05, no momentum",
        },
        results=results,
    )
    spark.stop()


if __name__ == "__main__":
    main()
