"""Compression on a communication-bound workload (issue 15): each strategy with and without
compression, on the same data, model and epochs, in one run: wall time per epoch, bytes sent
per worker, held-out accuracy after every epoch, and the wall time to reach the
uncompressed all-reduce run's final accuracy (within a point).

The model has about 2.4M parameters (9.5 MB of float32), so that on a 1 Gbit/s link one
all-reduce costs more than a step's compute. Run it on loopback and on a slow link:

    .venv/bin/python benchmarks/bench_compression.py [--rows 60000] [--epochs 3]
    ../shared/tools/slow-net --rate 1gbit -- .venv/bin/python benchmarks/bench_compression.py \\
        --over-sockets --output benchmarks/results/compression_1gbit.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # spark_setup sets the environment and puts sparkdl on the path

from common import save_report  # noqa: E402
from spark_setup import bench_session, dataframe  # noqa: E402
from torch import nn  # noqa: E402

from sparkdl import TorchEstimator  # noqa: E402

HIDDEN = 1536

VARIANTS = [
    ("allreduce", {"strategy": "allreduce"}),
    ("allreduce fp16", {"strategy": "allreduce", "compression": "fp16"}),
    ("allreduce 1bit", {"strategy": "allreduce", "compression": "1bit"}),
    ("allreduce powersgd", {"strategy": "allreduce", "compression": "powersgd"}),
    ("weight_averaging tau=4", {"strategy": "weight_averaging", "sync_every": 4}),
    ("weight_averaging tau=4 1bit", {"strategy": "weight_averaging", "sync_every": 4, "compression": "1bit"}),
    # DiLoCo (issue 34): long rounds, the average change applied by Nesterov momentum
    ("weight_averaging tau=100", {"strategy": "weight_averaging", "sync_every": 100}),
    (
        "weight_averaging tau=100 nesterov",
        {"strategy": "weight_averaging", "sync_every": 100, "outer_optimizer": "nesterov"},
    ),
    (
        "weight_averaging tau=100 nesterov 1bit",
        {
            "strategy": "weight_averaging",
            "sync_every": 100,
            "outer_optimizer": "nesterov",
            "compression": "1bit",
        },
    ),
    ("parameter_server sync", {"strategy": "parameter_server", "ps_mode": "sync"}),
    (
        "parameter_server sync 1bit",
        {"strategy": "parameter_server", "ps_mode": "sync", "compression": "1bit"},
    ),
    (
        "parameter_server sync 1bit bf16 pulls",
        {
            "strategy": "parameter_server",
            "ps_mode": "sync",
            "compression": "1bit",
            "ps_pull_precision": "bf16",
        },
    ),
]


def make_wide_model() -> nn.Module:
    from common import CLASSES, WIDTH

    return nn.Sequential(
        nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )


def run_variant(train_df, test_df, settings: dict, epochs: int, batch_size: int) -> dict:
    estimator = TorchEstimator(
        model_fn=make_wide_model,
        feature_cols=["features"],
        num_workers=2,
        batch_size=batch_size,
        epochs=epochs,
        seed=0,
        optimizer="sgd",
        lr=0.1,
        momentum=0.5,
        validation=0.1,
        **settings,
    )
    started = time.perf_counter()
    model = estimator.fit(train_df)
    fit_s = time.perf_counter() - started
    rows = model.transform(test_df).select("label", "prediction").collect()
    elapsed, curve = 0.0, []
    for h in model.history:
        elapsed += h["seconds"]
        curve.append(
            {"epoch": h["epoch"], "train_s": round(elapsed, 2), "val_accuracy": h.get("val_accuracy")}
        )
    return {
        "fit_s": fit_s,
        "epoch_s": [h["seconds"] for h in model.history],
        "bytes_sent_per_worker": sum(h["bytes_sent"] for h in model.history),
        "bytes_received_per_worker": sum(h["bytes_received"] for h in model.history),
        "curve": curve,
        "test_accuracy": sum(int(r[0] == r[1]) for r in rows) / len(rows),
    }


def time_to(curve: list[dict], accuracy: float) -> float | None:
    """Training seconds until the held-out accuracy first reached ``accuracy``."""
    return next((p["train_s"] for p in curve if (p["val_accuracy"] or 0) >= accuracy), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--test-rows", type=int, default=10_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--only", default="", help="comma-separated variant names (allreduce always runs)")
    parser.add_argument("--output", default=str(HERE / "results/compression.json"))
    parser.add_argument(
        "--over-sockets",
        action="store_true",
        help="shared_memory = false: the workers of this one host exchange over gloo's sockets, as "
        "across hosts, so that slow-net's rate applies to them",
    )
    args = parser.parse_args()
    wanted = {"allreduce", *filter(None, args.only.split(","))}
    variants = [(name, s) for name, s in VARIANTS if not args.only or name in wanted]
    spark = bench_session("sparkdl-bench-compression")
    train_df, test_df = dataframe(spark, args.rows, 2, seed=0), dataframe(spark, args.test_rows, 2, seed=1)
    results = {}
    for name, settings in variants:
        if args.over_sockets:
            settings = {**settings, "shared_memory": False}
        results[name] = run_variant(train_df, test_df, settings, args.epochs, args.batch_size)
        print(
            name,
            {k: results[name][k] for k in ("fit_s", "bytes_sent_per_worker", "test_accuracy")},
            flush=True,
        )
    base = results["allreduce"]
    target = base["curve"][-1]["val_accuracy"] - 0.01
    base_time = time_to(base["curve"], target)
    for result in results.values():
        reached = time_to(result["curve"], target)
        result["time_to_target_s"] = reached
        result["speedup_to_target_vs_allreduce"] = base_time / reached if reached and base_time else None
        result["bytes_vs_allreduce"] = result["bytes_sent_per_worker"] / base["bytes_sent_per_worker"]
    params = sum(p.numel() for p in make_wide_model().parameters())
    save_report(
        args.output,
        setup={
            "rows": args.rows,
            "epochs": args.epochs,
            "batch_size_per_worker": args.batch_size,
            "workers": 2,
            "parameters": params,
            "optimizer": "SGD lr=0.1 momentum=0.5",
            "target_val_accuracy": target,
            "exchange": "gloo over sockets" if args.over_sockets else "shared memory (one host)",
        },
        results=results,
    )
    spark.stop()


if __name__ == "__main__":
    main()
