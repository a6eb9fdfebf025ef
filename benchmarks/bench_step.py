"""What sparkdl's training loop costs per step, against a bare loop: one worker, no Spark.

    .venv/bin/python benchmarks/bench_step.py [--device cuda] [--rows 200000] [--profile]

Both loops train bench_gpu's wide MLP (Adam, batches of 512) on the same rows, one worker,
on the same device:

- ``bare``: the data already in device memory, a random permutation per epoch, indexing,
  forward, backward, step (what a hand-written loop does; the ceiling);
- ``bare_fed``: the same, but each batch copied from (pinned, on a GPU) host memory, as any
  loop whose data does not fit the device must;
- ``sparkdl``: ``run_worker``, the function a barrier task calls, strategy allreduce, fed
  by the partition feed (epoch 1 decodes and caches, epochs 2+ read the cache).

Epochs 2+ are timed. ``--profile`` prints the heaviest functions of the sparkdl loop
(cProfile), to say where its extra milliseconds per step go. Results: benchmarks/results/step.json.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import bench_gpu  # noqa: E402
from benchmarks.bench_gpu import make_wide_model  # noqa: E402
from benchmarks.common import make_data, make_table, save_report  # noqa: E402

BATCH = 512


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare(device: torch.device, rows: int, epochs: int, fed: bool) -> float:
    """Samples/s of epochs 2+ of a hand-written loop."""
    x, y = make_data(rows)
    x_host, y_host = torch.from_numpy(x), torch.from_numpy(y)
    if fed and device.type == "cuda":
        x_host, y_host = x_host.pin_memory(), y_host.pin_memory()
    x_dev, y_dev = x_host.to(device), y_host.to(device)
    torch.manual_seed(0)
    model = make_wide_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    timings = []
    for _ in range(epochs):
        _sync(device)
        started = time.perf_counter()
        if fed:
            order = torch.randperm(rows)
            for start in range(0, rows, BATCH):
                index = order[start : start + BATCH]
                xb = x_host[index].to(device, non_blocking=True)
                yb = y_host[index].to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(xb), yb).backward()
                optimizer.step()
        else:
            order = torch.randperm(rows, device=device)
            for start in range(0, rows, BATCH):
                index = order[start : start + BATCH]
                optimizer.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(x_dev[index]), y_dev[index]).backward()
                optimizer.step()
        _sync(device)
        timings.append(time.perf_counter() - started)
    later = timings[1:] or timings
    return rows * len(later) / sum(later)


def sparkdl_loop(device: torch.device, rows: int, epochs: int, profile: bool) -> tuple[float, str]:
    """Samples/s of epochs 2+ of ``run_worker`` (one worker), and its profile when asked."""
    from sparkdl.config import SparkDLConfig
    from sparkdl.data.columns import LabelKind
    from sparkdl.data.inputs import plan_data
    from sparkdl.worker.assembly import Placement, TrainSpec, run_worker

    table = make_table(rows)
    plan = plan_data(
        table.schema, feature_cols=("features",), label_col="label", label_kind=LabelKind.CLASS_INDEX
    )
    config = SparkDLConfig().replace(
        num_workers=1,
        batch_size=BATCH,
        epochs=epochs,
        optimizer="adam",
        lr=0.01,
        use_gpu="true" if device.type == "cuda" else "false",
        progress=False,
        collective_timeout_s=60.0,
    )
    spec = TrainSpec(config, make_wide_model, None, "cross_entropy", plan)
    placement = Placement(0, 1, "127.0.0.1", gpu_addresses=("0",) if device.type == "cuda" else ())
    profiler = cProfile.Profile() if profile else None
    with tempfile.TemporaryDirectory() as folder:
        spec = dataclasses.replace(spec, config=config.replace(cache_dir=folder))
        if profiler:
            profiler.enable()
        result = run_worker(spec, iter(table.to_batches(max_chunksize=10_000)), placement, lambda m: [m])
        if profiler:
            profiler.disable()
    later = result.history[1:] or result.history
    rate = sum(h["samples"] for h in later) / sum(h["seconds"] for h in later)
    report = ""
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumtime").print_stats(45)
        report = out.getvalue()
    return rate, report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--wide", type=int, default=bench_gpu.WIDE, help="hidden width (small: the loop's overhead shows)"
    )
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/step.json"))
    args = parser.parse_args()
    bench_gpu.WIDE = args.wide
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # what a worker of one core does
    rates: dict[str, list[float]] = {"bare": [], "bare_fed": [], "sparkdl": []}
    for _ in range(args.repeats):  # interleaved
        rates["bare"].append(bare(device, args.rows, args.epochs, fed=False))
        rates["bare_fed"].append(bare(device, args.rows, args.epochs, fed=True))
        rates["sparkdl"].append(sparkdl_loop(device, args.rows, args.epochs, profile=False)[0])
    median = {k: statistics.median(v) for k, v in rates.items()}
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "samples_per_s": {k: round(v) for k, v in median.items()},
        "ms_per_step": {k: round(BATCH / v * 1e3, 3) for k, v in median.items()},
        "sparkdl_over_bare": round(median["sparkdl"] / median["bare"], 3),
        "sparkdl_over_bare_fed": round(median["sparkdl"] / median["bare_fed"], 3),
    }
    save_report(args.output, **report)
    if args.profile:
        print(sparkdl_loop(device, args.rows, args.epochs, profile=True)[1])


if __name__ == "__main__":
    main()
