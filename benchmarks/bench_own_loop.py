"""Your own loop: what sparkdl's TorchDistributor and ``sparkdl.run`` cost.

    .venv/bin/python benchmarks/bench_own_loop.py distributor [--repeats 3]
    .venv/bin/python benchmarks/bench_own_loop.py loop [--rows 100000] [--epochs 3] [--device cuda]

``distributor``: one training function (PySpark's docstring example filled in: DDP on
gloo, the benchmark MLP, 50 steps of batch 128 on generated data, rank 0 returns the
model) under PySpark's ``TorchDistributor`` and under ``sparkdl.TorchDistributor``, both
``num_processes=2, local_mode=False`` on ``local[2]``; wall time of the first call of each
(after one Spark job started the Python workers) and of later calls, alternated.

``loop``: samples/s of one worker training the benchmark MLP (SGD with momentum, batch
128) on the same Arrow rows for the same epochs, through the Estimator's worker
(``run_worker``: sparkdl's loop) and through ``run_own_loop`` with a plain user loop over
``ctx.batches`` (the same feed, the user's backward and step); no Spark, one process,
alternated. Target: the own loop at 0.95 or more of the Estimator's.
Results: benchmarks/results/own_loop_<part>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from benchmarks.common import make_model, make_optimizer, make_table, save_report  # noqa: E402

BATCH = 128


def ddp_function(steps: int, code: str) -> Any:
    """What a PySpark TorchDistributor user writes: init, DDP, a loop, destroy, return."""
    import sys

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, code)
    from benchmarks.common import WIDTH, make_model, make_optimizer

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = make_model()
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(ddp.parameters())
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randn(BATCH, WIDTH, generator=generator)
        y = torch.randint(0, 10, (BATCH,), generator=generator)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()
    return model


def distributor(repeats: int) -> dict[str, Any]:
    from pyspark import cloudpickle as pyspark_cloudpickle
    from pyspark.ml.torch.distributor import TorchDistributor as PySparkDistributor

    from benchmarks.spark_setup import bench_session
    from sparkdl import TorchDistributor

    spark = bench_session("sparkdl-bench-own-loop")
    spark.range(0, 2, 1, 2).count()  # the Python workers exist before either first call
    pyspark_cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ways = {
        "sparkdl": lambda: TorchDistributor(2, local_mode=False, use_gpu=False).run(
            ddp_function, 50, str(ROOT)
        ),
        "pyspark": lambda: PySparkDistributor(2, local_mode=False, use_gpu=False).run(
            ddp_function, 50, str(ROOT)
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats + 1):
        for name, call in ways.items():
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
            print(name, round(times[name][-1], 2), flush=True)
    summary: dict[str, Any] = {}
    for name, runs in times.items():
        summary[name] = {"first_s": runs[0], "warm_s": runs[1:], "warm_median_s": statistics.median(runs[1:])}
    summary["first_ratio"] = times["sparkdl"][0] / times["pyspark"][0]
    summary["warm_ratio"] = summary["sparkdl"]["warm_median_s"] / summary["pyspark"]["warm_median_s"]
    spark.stop()
    return summary


def user_loop(ctx: Any) -> None:
    """A plain loop over ctx's feed: the user's loss, backward and step."""
    import torch.nn.functional as F

    from benchmarks.common import make_model, make_optimizer

    model = make_model()
    model, optimizer = ctx.prepare(model, make_optimizer(model.parameters()))
    for epoch in ctx.epochs:
        for batch in ctx.batches(epoch):
            (x,) = batch.inputs.values()
            loss = F.cross_entropy(model(x), batch.label)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()


def loop(rows: int, epochs: int, repeats: int, device: str) -> dict[str, Any]:
    import cloudpickle

    from sparkdl.config import SparkDLConfig
    from sparkdl.data.columns import LabelKind
    from sparkdl.data.inputs import plan_data
    from sparkdl.worker.assembly import Placement, TrainSpec, run_worker
    from sparkdl.worker.own_loop import LoopSpec, run_own_loop

    table = make_table(rows)
    plan = plan_data(
        table.schema, feature_cols=("features",), label_col="label", label_kind=LabelKind.CLASS_INDEX
    )
    config = SparkDLConfig().replace(
        num_workers=1,
        batch_size=BATCH,
        epochs=epochs,
        use_gpu="true" if device == "cuda" else "false",
        progress=False,
        preflight=False,
    )
    placement = Placement(
        0, 1, "127.0.0.1", ("0",) if device == "cuda" else (), torch_threads=os.cpu_count() or 1
    )

    def estimator() -> None:
        spec = TrainSpec(config, make_model, make_optimizer, "cross_entropy", plan)
        run_worker(spec, iter(table.to_batches(8192)), placement, lambda m: [m])

    def own() -> None:
        spec = LoopSpec(config, cloudpickle.dumps((user_loop, (), {})), "user_loop", plan)
        run_own_loop(spec, iter(table.to_batches(8192)), placement, lambda m: [m])

    ways = {"estimator": estimator, "own_loop": own}
    for call in ways.values():
        call()  # warm-up: first optimizer, kernels
    speeds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, call in ways.items():
            started = time.perf_counter()
            call()
            speeds[name].append(rows * epochs / (time.perf_counter() - started))
            print(name, round(speeds[name][-1]), flush=True)
    medians = {name: statistics.median(v) for name, v in speeds.items()}
    return {
        "rows": rows,
        "epochs": epochs,
        "batch_size": BATCH,
        "device": device,
        "samples_per_s": speeds,
        "median_samples_per_s": medians,
        "ratio": medians["own_loop"] / medians["estimator"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("part", choices=["distributor", "loop"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.part == "distributor":
        result = distributor(args.repeats)
    else:
        result = loop(args.rows, args.epochs, args.repeats, args.device)
    out = args.out or str(ROOT / f"benchmarks/results/own_loop_{args.part}.json")
    save_report(out, **{args.part: result})


if __name__ == "__main__":
    main()
