"""GPU figures: fit against bare DDP with NCCL, the feed into pinned memory, and fsdp.

    .venv/bin/python benchmarks/bench_gpu.py [--rows 200000] [--epochs 3] [--repeats 2]
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --rows 20000   # a dry run without a GPU

On a machine with CUDA (one worker per GPU, up to 2), in a ``local-cluster`` whose worker
holds the GPUs (found by an ``nvidia-smi`` discovery script; the training stage asks one
GPU per task through its own resource profile, as on a real cluster):

(a) samples/s of ``fit`` (strategy allreduce, NCCL, epochs 2+ from the epoch cache)
    against bare ``torchrun`` + DDP on the same GPUs with the data already in GPU memory;
(b) rows/s of the feed (decode, epoch cache, shuffle, batches) delivering batches to the
    GPU, with pinned host memory and non-blocking copies against pageable memory;
(c) samples/s and each worker's peak GPU memory (``worker_peak_gpu_mb`` in the history)
    of strategy fsdp against allreduce, training with Adam.

``--device cpu`` runs the same code on CPU (gloo, pageable memory, local[2]): it checks the
script, not the GPU. Results: benchmarks/results/gpu.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import make_table, save_report  # noqa: E402

WIDE = 1024  # the GPU model: wide enough that a step is GPU work, not launch overhead
DISCOVERY = (
    "#!/usr/bin/env bash\n"
    "ids=$(nvidia-smi --query-gpu=index --format=csv,noheader | head -n {n}"
    " | sed 's/.*/\"&\"/' | paste -sd, -)\n"
    'echo "{{\\"name\\": \\"gpu\\", \\"addresses\\": [$ids]}}"\n'
)


def make_wide_model() -> torch.nn.Module:
    from benchmarks.common import CLASSES, WIDTH

    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDE),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDE, WIDE),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDE, WIDE),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDE, CLASSES),
    )


def session(device: str, workers: int, folder: Path) -> Any:
    from sparkdl.config import SparkDLConfig
    from sparkdl.spark.session import build_session

    extra = {"spark.ui.enabled": "false", "spark.driver.host": "127.0.0.1"}
    master = f"local[{workers}]"
    if device == "cuda":
        script = folder / "gpus.sh"
        script.write_text(DISCOVERY.format(n=workers))
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        master = f"local-cluster[1,{workers},8192]"
        extra.update(
            {
                "spark.worker.resource.gpu.amount": str(workers),
                "spark.worker.resource.gpu.discoveryScript": str(script),
                "spark.executor.resource.gpu.amount": str(workers),
            }
        )
    spark = build_session(master, "sparkdl-bench-gpu", SparkDLConfig(), extra)
    spark.sparkContext.setLogLevel("ERROR")
    spark.sparkContext.addPyFile(str(ROOT / "benchmarks/common.py"))
    spark.sparkContext.addPyFile(str(Path(__file__)))
    return spark


def dataframe(spark: Any, rows: int, partitions: int) -> Any:
    table = make_table(rows)
    df = spark.createDataFrame(table).repartition(partitions).cache()
    df.count()
    return df


def fit(df: Any, workers: int, epochs: int, strategy: str, optimizer: str) -> dict[str, Any]:
    from sparkdl import TorchEstimator

    model = TorchEstimator(
        model_fn=make_wide_model,
        loss_fn="cross_entropy",
        optimizer=optimizer,
        lr=0.01,
        num_workers=workers,
        batch_size=512,
        epochs=epochs,
        strategy=strategy,
        progress=False,
        use_gpu="auto",
        collective_timeout_s=300.0,
    ).fit(df)
    later = model.history[1:] or model.history
    return {
        "samples_per_s": sum(h["samples"] for h in later) / sum(h["seconds"] for h in later),
        "peak_gpu_mb": model.history[-1].get("worker_peak_gpu_mb", []),
        "devices": [d["device"] for d in model.worker_devices],
    }


BARE = r"""
import json, sys, time
sys.path.insert(0, {bench!r})
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from bench_gpu import make_wide_model
from common import make_data
device_kind = {device!r}
dist.init_process_group("nccl" if device_kind == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device(f"cuda:{{rank}}") if device_kind == "cuda" else torch.device("cpu")
x, y = make_data({rows})
x = torch.from_numpy(x[rank::world]).to(device); y = torch.from_numpy(y[rank::world]).to(device)
torch.manual_seed(0)
model = DistributedDataParallel(make_wide_model().to(device))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
timings = []
for epoch in range({epochs}):
    if device_kind == "cuda": torch.cuda.synchronize()
    started = time.perf_counter()
    order = torch.randperm(len(y), device=device)
    for start in range(0, len(y), 512):
        index = order[start:start + 512]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[index]), y[index]).backward()
        optimizer.step()
    if device_kind == "cuda": torch.cuda.synchronize()
    timings.append(time.perf_counter() - started)
if rank == 0:
    later = timings[1:] or timings
    print(json.dumps({{"samples_per_s": len(y) * world * len(later) / sum(later)}}))
dist.destroy_process_group()
"""


def bare_ddp(device: str, workers: int, rows: int, epochs: int) -> float:
    code = BARE.format(bench=str(ROOT / "benchmarks"), device=device, rows=rows, epochs=epochs)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(code)
    try:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={workers}", script.name]
        out = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True)
    finally:
        os.unlink(script.name)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["samples_per_s"])


def feed_rate(device: str, rows: int, pinned: bool) -> float:
    """Rows/s of the feed handing batches of 512 to ``device`` (epoch 1, then epoch 2 from
    the cache), with or without pinned host memory."""
    from sparkdl.data.feed import FeedOptions, PartitionFeed
    from sparkdl.data.inputs import plan_data

    table = make_table(rows)
    batches = table.to_batches(max_chunksize=10_000)
    plan = plan_data(table.schema, feature_cols=("features",), label_col="label")
    target = torch.device("cuda" if device == "cuda" else "cpu")
    with tempfile.TemporaryDirectory() as cache:
        options = FeedOptions(512, shuffle=True, seed=0, rank=0, prefetch_batches=4, cache_dir=cache)
        options = dataclasses.replace(options, pin_memory=pinned)
        feed = PartitionFeed(iter(batches), plan, options)
        try:
            started = time.perf_counter()
            seen = 0
            for epoch in (1, 2):
                batches_of_epoch, _ = feed.epoch(epoch)
                for batch in batches_of_epoch:
                    moved = batch.to(target)
                    seen += len(moved)
            if device == "cuda":
                torch.cuda.synchronize()
            return seen / (time.perf_counter() - started)
        finally:
            feed.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a machine with a GPU, or pass --device cpu for a dry run")
    workers = min(torch.cuda.device_count(), 2) if args.device == "cuda" else 2
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"}

    feed = {"pinned": [], "pageable": []}
    for _ in range(args.repeats):
        for kind in feed:
            feed[kind].append(feed_rate(args.device, args.rows, kind == "pinned" and args.device == "cuda"))
    report["feed_rows_per_s"] = {k: round(statistics.median(v)) for k, v in feed.items()}

    with tempfile.TemporaryDirectory() as folder:
        spark = session(args.device, workers, Path(folder))
        df = dataframe(spark, args.rows, workers)
        fits: dict[str, list[dict[str, Any]]] = {"bare_ddp": [], "allreduce": [], "fsdp": []}
        for _ in range(args.repeats):  # interleaved
            fits["allreduce"].append(fit(df, workers, args.epochs, "allreduce", "adam"))
            fits["fsdp"].append(fit(df, workers, args.epochs, "fsdp", "adam"))
            fits["bare_ddp"].append({"samples_per_s": bare_ddp(args.device, workers, args.rows, args.epochs)})
        spark.stop()
    rate = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in fits.items() if v}
    report["workers"] = workers
    report["samples_per_s"] = {k: round(v) for k, v in rate.items()}
    report["fit_over_bare_ddp"] = round(rate["allreduce"] / rate["bare_ddp"], 3)
    report["fsdp_over_allreduce"] = round(rate["fsdp"] / rate["allreduce"], 3)
    report["peak_gpu_mb"] = {k: v[-1]["peak_gpu_mb"] for k, v in fits.items() if v and "peak_gpu_mb" in v[-1]}
    report["devices"] = fits["allreduce"][-1]["devices"]
    save_report(str(ROOT / "benchmarks/results/gpu.json"), **report)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
