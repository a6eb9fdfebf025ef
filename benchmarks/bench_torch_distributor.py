"""End to end against PySpark's TorchDistributor: a DataFrame in, a trained model out.

    .venv/bin/python benchmarks/bench_torch_distributor.py [--rows 200000] [--epochs 3] [--repeats 3]

Both train the benchmark MLP (benchmarks/common.py) with 2 workers, batch 128 per worker,
SGD with momentum, on the same cached DataFrame, and hand back the trained weights on
the driver. The clock runs from the DataFrame to the weights:

- sparkdl: ``TorchEstimator(...).fit(df)``;
- TorchDistributor as its documentation suggests for DataFrame input: write the
  DataFrame to Parquet, then ``TorchDistributor(num_processes=2, local_mode=False).run``
  a function in which every rank (torchrun inside a barrier task) reads its share of
  the Parquet files and runs a DDP loop; rank 0 returns the state dict.

Two jobs: the 200,000-row, 3-epoch job, timed with interleaved repeats, and a trivial one
(2,000 rows, 1 epoch) that shows each way's fixed cost, timed in blocks of each way's runs
(a session that uses it; see compare_in_blocks) and interleaved as well. A warm-up fit of
each runs first (the session's first-fit costs are measured by bench_first_fit.py).
Results: benchmarks/results/torch_distributor.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import make_model, make_optimizer, save_report  # noqa: E402
from benchmarks.spark_setup import bench_session, dataframe  # noqa: E402
from sparkdl import TorchEstimator  # noqa: E402

BATCH = 128


def train_on_parquet(path: str, epochs: int, batch_size: int, code: str) -> dict[str, Any]:
    """Runs under torchrun in each barrier task: this rank's share of the files, DDP, SGD."""
    import glob
    import os
    import sys

    sys.path.insert(0, code)  # benchmarks/common.py: torchrun's processes do not see addPyFile

    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    from common import make_model, make_optimizer
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    files = sorted(glob.glob(os.path.join(path, "*.parquet")))[rank::world]
    table = pq.read_table(files)
    features = table.column("features").combine_chunks()
    x = torch.from_numpy(features.values.to_numpy().reshape(len(table), -1).copy())
    y = torch.from_numpy(table.column("label").to_numpy().copy())
    torch.manual_seed(0)
    model = DistributedDataParallel(make_model())
    optimizer = make_optimizer(model.parameters())
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(y), batch_size):
            index = order[start : start + batch_size]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    dist.destroy_process_group()
    return state if rank == 0 else {}


def with_torch_distributor(df: Any, epochs: int) -> dict[str, Any]:
    from pyspark.ml.torch.distributor import TorchDistributor

    folder = tempfile.mkdtemp(prefix="sparkdl-bench-td-")
    try:
        df.write.mode("overwrite").parquet(folder)
        distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
        return distributor.run(train_on_parquet, folder, epochs, BATCH, str(ROOT / "benchmarks"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def with_sparkdl(df: Any, epochs: int) -> dict[str, Any]:
    model = TorchEstimator(
        model_fn=make_model,
        optimizer_fn=make_optimizer,
        loss_fn="cross_entropy",
        num_workers=2,
        batch_size=BATCH,
        epochs=epochs,
        progress=False,
        torch_threads=1,
    ).fit(df)
    return model.module.state_dict()


def timed(job: Any, df: Any, epochs: int) -> float:
    started = time.perf_counter()
    state = job(df, epochs)
    assert state, "no weights came back"
    return time.perf_counter() - started


def _summary(runs: dict[str, list[float]]) -> dict[str, Any]:
    median = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "seconds": {k: [round(t, 2) for t in v] for k, v in runs.items()},
        "median_s": {k: round(v, 2) for k, v in median.items()},
        "sparkdl_over_torch_distributor": round(median["sparkdl"] / median["torch_distributor"], 3),
    }


def compare(df: Any, epochs: int, repeats: int) -> dict[str, Any]:
    runs: dict[str, list[float]] = {"sparkdl": [], "torch_distributor": []}
    for _ in range(repeats):
        runs["sparkdl"].append(timed(with_sparkdl, df, epochs))
        runs["torch_distributor"].append(timed(with_torch_distributor, df, epochs))
        print({k: round(v[-1], 2) for k, v in runs.items()}, flush=True)
    return _summary(runs)


def compare_in_blocks(df: Any, epochs: int, repeats: int) -> dict[str, Any]:
    """Each way's runs back to back, in two rounds (sparkdl, TorchDistributor, sparkdl,
    TorchDistributor): a way's fixed cost as in a session that uses it. Interleaved one by
    one, every sparkdl fit ran on Python workers freshly forked by Spark (TorchDistributor's
    job leaves none to reuse: measured +0.5 s before the tasks start, +0.2 s of first steps)."""
    runs: dict[str, list[float]] = {"sparkdl": [], "torch_distributor": []}
    jobs = {"sparkdl": with_sparkdl, "torch_distributor": with_torch_distributor}
    for _ in range(2):
        for name, job in jobs.items():
            timed(job, df, epochs)  # the first after the other way's: workers and caches warm up
            for _ in range(repeats):
                runs[name].append(timed(job, df, epochs))
            print(name, [round(t, 2) for t in runs[name]], flush=True)
    return _summary(runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    spark = bench_session("sparkdl-bench-torch-distributor")
    trivial_df = dataframe(spark, 2_000, 2)
    timed(with_sparkdl, trivial_df, 1)  # warm-up: the session's first fit, first Parquet write
    timed(with_torch_distributor, trivial_df, 1)
    trivial = compare_in_blocks(trivial_df, 1, args.repeats)
    trivial["interleaved"] = compare(trivial_df, 1, args.repeats)
    full = compare(dataframe(spark, args.rows, 2), args.epochs, args.repeats)
    save_report(
        str(ROOT / "benchmarks/results/torch_distributor.json"),
        job={"rows": args.rows, "epochs": args.epochs, "workers": 2, "batch_size": BATCH, **full},
        trivial_job={"rows": 2_000, "epochs": 1, "workers": 2, **trivial},
    )


if __name__ == "__main__":
    main()
