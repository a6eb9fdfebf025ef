"""Compression on a communication-bound workload (issue 15): each strategy with and without
compression, on the same data, model and epochs, in one run: wall time per epoch, bytes sent
per worker, the held-out figure after every epoch, and the wall time to reach the
uncompressed all-reduce run's final figure.

Two workloads (``--workload``):

- ``mlp`` (default): a 2.4M-parameter MLP (9.5 MB of float32) on synthetic 10-class rows, so
  that on a 1 Gbit/s link one all-reduce costs more than a step's compute; SGD with momentum;
  the target is all-reduce's final held-out accuracy less a point.
- ``lm``: a small decoder-only transformer (:class:`sparkdl.apps.models.CausalLMFactory`) trained
  from a DataFrame of token sequences: the bytes of Python's own standard library sources
  (every tenth file held out), 64 tokens a row, the label the same bytes one on; AdamW, as
  DiLoCo's inner optimizer. The target is all-reduce's final held-out perplexity, plus 2%.

Run it on loopback and on a slow link:

    .venv/bin/python benchmarks/bench_compression.py [--rows 60000] [--epochs 3]
    ../shared/tools/slow-net --rate 1gbit -- .venv/bin/python benchmarks/bench_compression.py \\
        --over-sockets --output benchmarks/results/compression_1gbit.json
    ../shared/tools/slow-net --rate 100mbit -- .venv/bin/python benchmarks/bench_compression.py \\
        --workload lm --over-sockets --only "weight_averaging tau=100,weight_averaging tau=100 nesterov" \\
        --output benchmarks/results/diloco_lm_100mbit.json
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # spark_setup sets the environment and puts sparkdl on the path

from common import save_report  # noqa: E402
from spark_setup import bench_session, dataframe  # noqa: E402
from torch import nn  # noqa: E402

from sparkdl import TorchEstimator  # noqa: E402
from sparkdl.apps.models import CausalLMFactory  # noqa: E402

HIDDEN = 1536
SEQUENCE = 64  # tokens a row of the lm workload

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
    (  # Streaming DiLoCo: four fragments at staggered steps, each overlapping 5 steps of training
        "weight_averaging tau=100 nesterov streaming",
        {
            "strategy": "weight_averaging",
            "sync_every": 100,
            "outer_optimizer": "nesterov",
            "fragments": 4,
            "fragment_delay": 5,
            "fragment_mix": 0.5,
        },
    ),
    ("weight_averaging tau=200", {"strategy": "weight_averaging", "sync_every": 200}),
    (
        "weight_averaging tau=200 nesterov streaming",
        {
            "strategy": "weight_averaging",
            "sync_every": 200,
            "outer_optimizer": "nesterov",
            "fragments": 4,
            "fragment_delay": 5,
            "fragment_mix": 0.5,
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


@dataclass(frozen=True)
class Workload:
    """What every variant of one workload shares: the model, its columns and optimizer, and
    the held-out figure the variants race to (``better`` says which way is better)."""

    model_fn: Callable[[], nn.Module]
    settings: dict
    figure: str
    better: Callable[[float, float], bool]
    validates_on_test_rows: bool  # or on a tenth of the training rows, then tests with transform

    def reached(self, value: float | None, target: float) -> bool:
        return value is not None and (value == target or self.better(value, target))


MLP = Workload(
    make_wide_model,
    {"feature_cols": ["features"], "optimizer": "sgd", "lr": 0.1, "momentum": 0.5},
    "val_accuracy",
    lambda value, target: value > target,
    validates_on_test_rows=False,
)
LM = Workload(
    CausalLMFactory(vocab_size=256, context=SEQUENCE, dim=128, layers=2, heads=4),
    {"inputs": {"tokens": "tokens"}, "label_col": "next", "optimizer": "adamw", "lr": 1e-3},
    "val_perplexity",
    lambda value, target: value < target,
    validates_on_test_rows=True,
)


def byte_sequences(spark, files: list[Path], budget: int, partitions: int) -> Any:
    """A cached DataFrame (tokens array<int>, next array<int>) of ``budget`` bytes of ``files``,
    cut into rows of SEQUENCE tokens, the label the same bytes one position on."""
    import numpy as np
    import pyarrow as pa

    data = bytearray()
    for path in files:
        if len(data) >= budget:
            break
        data += path.read_bytes()
    ids = np.frombuffer(bytes(data[:budget]), np.uint8).astype(np.int32)
    rows = (len(ids) - 1) // SEQUENCE
    windows = np.lib.stride_tricks.sliding_window_view(ids, SEQUENCE + 1)[: rows * SEQUENCE : SEQUENCE]

    def column(values):
        flat = pa.array(np.ascontiguousarray(values).reshape(-1))
        return pa.FixedSizeListArray.from_arrays(flat, SEQUENCE).cast(pa.list_(pa.int32()))

    table = pa.table({"tokens": column(windows[:, :-1]), "next": column(windows[:, 1:])})
    df = spark.createDataFrame(table.to_pandas()).repartition(partitions).cache()
    df.count()
    return df


def lm_frames(spark, rows: int, test_rows: int) -> tuple[Any, Any]:
    """Training and held-out rows from Python's standard library sources (sorted; every tenth
    file held out), so the text ships with the interpreter and nothing is downloaded."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    held_out = files[::10]
    train = [f for f in files if f not in held_out]
    return (
        byte_sequences(spark, train, rows * SEQUENCE + 1, 2),
        byte_sequences(spark, held_out, test_rows * SEQUENCE + 1, 2),
    )


def run_variant(workload: Workload, train_df, test_df, settings: dict, epochs: int, batch_size: int) -> dict:
    estimator = TorchEstimator(
        model_fn=workload.model_fn,
        num_workers=2,
        batch_size=batch_size,
        epochs=epochs,
        seed=0,
        validation=test_df if workload.validates_on_test_rows else 0.1,
        **workload.settings,
        **settings,
    )
    started = time.perf_counter()
    model = estimator.fit(train_df)
    fit_s = time.perf_counter() - started
    tested = {}
    if not workload.validates_on_test_rows:
        rows = model.transform(test_df).select("label", "prediction").collect()
        tested["test_accuracy"] = sum(int(r[0] == r[1]) for r in rows) / len(rows)
    elapsed, curve = 0.0, []
    for h in model.history:
        elapsed += h["seconds"]
        figures = {"val_accuracy": h.get("val_accuracy"), "val_loss": h.get("val_loss")}
        if "val_loss" in h:
            figures["val_perplexity"] = math.exp(h["val_loss"])
        curve.append({"epoch": h["epoch"], "train_s": round(elapsed, 2), **figures})
    return {
        "fit_s": fit_s,
        "epoch_s": [h["seconds"] for h in model.history],
        "bytes_sent_per_worker": sum(h["bytes_sent"] for h in model.history),
        "bytes_received_per_worker": sum(h["bytes_received"] for h in model.history),
        "curve": curve,
        f"final_{workload.figure}": curve[-1][workload.figure],
        **tested,
    }


def time_to(workload: Workload, curve: list[dict], target: float) -> tuple[float, int] | None:
    """Training seconds and epochs until the held-out figure first reached ``target``."""
    return next(
        ((p["train_s"], p["epoch"]) for p in curve if workload.reached(p[workload.figure], target)), None
    )


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
    parser.add_argument("--workload", choices=["mlp", "lm"], default="mlp")
    parser.add_argument(
        "--local-epochs",
        type=int,
        default=0,
        help="epochs of the weight-averaging variants (0: --epochs): they may need more than "
        "all-reduce to reach its held-out figure, and take less time for each",
    )
    args = parser.parse_args()
    workload = LM if args.workload == "lm" else MLP
    wanted = {"allreduce", *filter(None, args.only.split(","))}
    variants = [(name, s) for name, s in VARIANTS if not args.only or name in wanted]
    spark = bench_session("sparkdl-bench-compression")
    if workload is LM:
        train_df, test_df = lm_frames(spark, args.rows, args.test_rows)
    else:
        train_df, test_df = (
            dataframe(spark, args.rows, 2, seed=0),
            dataframe(spark, args.test_rows, 2, seed=1),
        )
    results = {}
    for name, settings in variants:
        if args.over_sockets:
            settings = {**settings, "shared_memory": False}
        if workload is LM and settings.get("strategy") == "weight_averaging":
            settings = {**settings, "average_optimizer_state": False}  # DiLoCo: inner state stays local
        local = settings.get("strategy") == "weight_averaging" and args.local_epochs
        epochs = args.local_epochs if local else args.epochs
        results[name] = run_variant(workload, train_df, test_df, settings, epochs, args.batch_size)
        print(name, {k: v for k, v in results[name].items() if k != "curve"}, flush=True)
    base = results["allreduce"]
    final = base["curve"][-1][workload.figure]
    target = final - 0.01 if workload is MLP else final * 1.02
    base_reached = time_to(workload, base["curve"], target)
    for result in results.values():
        reached = time_to(workload, result["curve"], target)
        result["time_to_target_s"] = reached[0] if reached else None
        result["epochs_to_target"] = reached[1] if reached else None
        result["speedup_to_target_vs_allreduce"] = (
            base_reached[0] / reached[0] if reached and base_reached else None
        )
        result["bytes_vs_allreduce"] = result["bytes_sent_per_worker"] / base["bytes_sent_per_worker"]
        if reached and base_reached:  # the bytes sent until each reached it (epochs are even)
            spent = result["bytes_sent_per_worker"] * reached[1] / len(result["curve"])
            base_spent = base["bytes_sent_per_worker"] * base_reached[1] / len(base["curve"])
            result["bytes_to_target_vs_allreduce"] = spent / base_spent
    params = sum(p.numel() for p in workload.model_fn().parameters())
    save_report(
        args.output,
        setup={
            "workload": args.workload,
            "rows": args.rows,
            "test_rows": args.test_rows,
            "epochs": args.epochs,
            "weight_averaging_epochs": args.local_epochs or args.epochs,
            "batch_size_per_worker": args.batch_size,
            "workers": 2,
            "parameters": params,
            "model_and_optimizer": {k: v for k, v in workload.settings.items() if k != "inputs"},
            f"target_{workload.figure}": target,
            "exchange": "gloo over sockets" if args.over_sockets else "shared memory (one host)",
        },
        results=results,
    )
    spark.stop()


if __name__ == "__main__":
    main()
