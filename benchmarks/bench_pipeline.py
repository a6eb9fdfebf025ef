"""Model parallelism (issue 33): how close a pipeline comes to its ideal schedule, and
where pipeline and tensor parallelism send fewer bytes than data parallelism.

    .venv/bin/python benchmarks/bench_pipeline.py schedule [--epochs 3]
    ../shared/tools/slow-net --rate 1gbit -- .venv/bin/python benchmarks/bench_pipeline.py wide

``schedule``: a deep MLP (8 blocks of 1024 x 1024, equal cost) trained on 2 workers as 2
stages, GPipe and 1F1B, with m = 1, 2, 4, 8 micro-batches, against the same model on one
worker (the same 128 rows per step) and against all-reduce on 2 workers (64 rows each).
GPipe's ideal speed-up over one worker with p balanced stages is p * m / (m + p - 1):
the bubble leaves (p - 1) / (m + p - 1) of each stage idle.

``wide``: a wide MLP (64 -> 4096 -> 4096 -> 4096 -> 10, 33.9M parameters, 135 MB of
float32) with 64 rows per worker, on 2 workers, all-reduce over gloo (no shared memory:
the bytes cross slow-net's link) against a 2-stage pipeline (1F1B, 4 micro-batches): the
bytes each worker sends per step and samples/s; and tensor parallelism (each pair of
layers split over the 2 workers). Run it under slow-net.

``memory``: each worker's peak memory training a 1.0B-parameter bfloat16 model
(``billion_model``) on 2 workers under all-reduce, fsdp, pipeline and tensor parallelism.

No Spark: each worker is a process running the Estimator's worker (``run_worker``) on its
Arrow rows, as a barrier task would; samples/s is the median over the epochs after the
first. Results: benchmarks/results/pipeline_<part>.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import WIDTH, make_table, save_report  # noqa: E402


def deep_model() -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(WIDTH, 1024), nn.ReLU()]
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 10))


def wide_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(WIDTH, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
        nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10),
    )  # fmt: skip


class ToBfloat16(nn.Module):
    """The float32 features as bfloat16, the weights' dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16)


_BEFORE_BUILD_KIB: list[int] = []  # the worker's RSS when model_fn last started


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def billion_model() -> nn.Module:
    """About 1.0B parameters in bfloat16 (2.0 GB), created in bfloat16 (no float32 copy
    first): 61 layers of 4096 x 4096 between an input and an output layer, ReLUs between
    them (31 pairs for tensor parallelism). Resets the process's peak RSS (Linux's
    clear_refs) and records its RSS first, so the peak measured after training is what the
    model, its gradients and the strategy took."""
    Path("/proc/self/clear_refs").write_text("5")
    _BEFORE_BUILD_KIB[:] = [_status_kib("VmRSS")]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layers: list[nn.Module] = [ToBfloat16(), nn.Linear(WIDTH, 4096)]
        for _ in range(60):
            layers += [nn.ReLU(), nn.Linear(4096, 4096)]
        layers += [nn.ReLU(), nn.Linear(4096, 10)]
        return nn.Sequential(*layers)
    finally:
        torch.set_default_dtype(default)


MODELS = {"deep": deep_model, "wide": wide_model, "billion": billion_model}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _plain_sgd(params):
    return torch.optim.SGD(params, lr=1e-4)  # no state beside the weights


def _all_gather(path: str, rank: int, world: int):
    import torch.distributed as dist

    store = dist.FileStore(path, world)
    store.set_timeout(timedelta(seconds=120))
    rounds = iter(range(1_000))

    def all_gather(message: str) -> list[str]:
        round_ = next(rounds)
        store.set(f"msg{round_}-{rank}", message)
        return [store.get(f"msg{round_}-{r}").decode() for r in range(world)]

    return all_gather


def make_spec(world: int, rows: int, model: str, settings: dict) -> Any:
    """The task spec of a fit of ``model`` on ``world`` workers (the rows' plan from rank 0's)."""
    from sparkdl.config import SparkDLConfig
    from sparkdl.data.columns import LabelKind
    from sparkdl.data.decoding import decode_block
    from sparkdl.data.inputs import plan_data
    from sparkdl.data.tensors import to_batch
    from sparkdl.worker.assembly import TrainSpec

    first = make_table(rows, seed=0).to_batches()[0]
    plan = plan_data(
        first.schema, feature_cols=("features",), label_col="label", label_kind=LabelKind.CLASS_INDEX
    )
    template = to_batch(decode_block(first.slice(0, 2), plan), plan)
    config = SparkDLConfig().replace(num_workers=world, collective_timeout_s=600.0, **settings)
    optimizer = _plain_sgd if model == "billion" else _sgd
    return TrainSpec(config, MODELS[model], optimizer, "cross_entropy", plan, template)


def _worker(rank: int, world: int, rows: int, spec: Any, store: str, out: Any) -> None:
    from sparkdl.worker.assembly import Placement, run_worker

    try:
        table = make_table(rows, seed=rank)
        placement = Placement(rank, world, "127.0.0.1")
        result = run_worker(spec, iter(table.to_batches()), placement, _all_gather(store, rank, world))
        before = _BEFORE_BUILD_KIB[0] if _BEFORE_BUILD_KIB else 0
        out.put((rank, result.history, None, _status_kib("VmHWM") - before))
    except Exception as exc:  # reported to the parent
        out.put((rank, [], f"{type(exc).__name__}: {exc}", 0))


def fit(world: int, rows: int, model: str, **settings: Any) -> dict[str, Any]:
    """Train on ``world`` worker processes (``rows`` each); rank 0's figures. With strategy
    parameter_server this process hosts the server, as the driver would."""
    from sparkdl.spark.ps_host import host_parameter_server

    spec = make_spec(world, rows, model, settings)
    hosted = None
    if settings.get("strategy") == "parameter_server":
        hosted = host_parameter_server(spec, "127.0.0.1")
        spec = hosted.spec
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            procs = [
                ctx.Process(target=_worker, args=(r, world, rows, spec, f"{tmp}/store", out))
                for r in range(world)
            ]
            started = time.perf_counter()
            for p in procs:
                p.start()
            results = {
                rank: (history, error, peak)
                for rank, history, error, peak in (out.get(timeout=1800) for _ in procs)
            }
            for p in procs:
                p.join(60)
    finally:
        if hosted is not None:
            hosted.stop()
    errors = {r: e for r, (_, e, _) in results.items() if e}
    if errors:
        raise RuntimeError(f"{model} {settings}: {errors}")
    history = results[0][0]
    later = history[1:] or history
    steps = sum(h["steps"] for h in history)
    return {
        "samples_per_s": statistics.median(h["samples_per_s"] for h in later),
        "bytes_sent_per_step": sum(h["bytes_sent"] for h in history) / max(steps, 1),
        "bytes_received_per_step": sum(h.get("bytes_received", 0) for h in history) / max(steps, 1),
        "loss": history[-1]["loss"],
        "wall_s": time.perf_counter() - started,
        "peak_gb": [results[r][2] / 2**20 for r in sorted(results)],  # KiB above the RSS before the build
    }


def stage_ms(rows: int, repeats: int = 20) -> float:
    """One stage's forward and backward of ``rows`` rows here, one thread: the deep model's
    first half (the slower one), median of ``repeats``."""
    torch.set_num_threads(1)
    layers = list(deep_model().children())
    half = nn.Sequential(*layers[: len(layers) // 2])
    x = torch.randn(rows, WIDTH)
    times = []
    for i in range(repeats + 3):
        started = time.perf_counter()
        half(x).sum().backward()
        if i >= 3:
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def schedule(epochs: int) -> dict[str, Any]:
    rows, batch = 2_560, 64
    base = {"epochs": epochs, "shuffle": False}
    # the ideal schedule on this machine: (m + p - 1) stage-times of a micro-batch (GPipe),
    # each measured alone: a CPU's matmuls slow down per row as micro-batches shrink
    micro_ms = {m: stage_ms(2 * batch // m) for m in (1, 2, 4, 8)}
    one = fit(1, 2 * rows, "deep", batch_size=2 * batch, **base)
    print(f"one worker: {one['samples_per_s']:.0f} samples/s", flush=True)
    variants: dict[str, Any] = {"one worker, 128 rows a step": one}
    allreduce = fit(2, rows, "deep", batch_size=batch, **base)
    variants["allreduce, 2 workers"] = {
        **allreduce,
        "vs_one": allreduce["samples_per_s"] / one["samples_per_s"],
    }
    for kind in ("gpipe", "1f1b"):
        for m in (1, 2, 4, 8):
            if kind == "1f1b" and m < 2:
                continue
            figures = fit(
                2,
                rows,
                "deep",
                batch_size=batch,
                strategy="pipeline",
                microbatches=m,
                pipeline_schedule=kind,
                **base,
            )
            vs_one = figures["samples_per_s"] / one["samples_per_s"]
            step_ms = 2 * batch / figures["samples_per_s"] * 1e3
            ideal_ms = (m + 1) * micro_ms[m]  # p = 2 stages
            variants[f"pipeline {kind} m={m}"] = {
                **figures,
                "vs_one": vs_one,
                "ideal_speedup": 2 * m / (m + 1),
                "step_ms": step_ms,
                "ideal_schedule_ms": ideal_ms,
                "of_ideal_schedule": ideal_ms / step_ms,
            }
            print(
                f"{kind} m={m}: {vs_one:.2f}x one worker (ideal {2 * m / (m + 1):.2f})"
                f"; step {step_ms:.0f} ms "
                f"against the schedule's {ideal_ms:.0f} ms of stage compute",
                flush=True,
            )
    return variants


def wide(epochs: int) -> dict[str, Any]:
    rows, batch = 1_280, 64
    base = {"epochs": epochs, "shuffle": False, "batch_size": batch}
    variants = {
        "allreduce over gloo": fit(2, rows, "wide", shared_memory=False, **base),
        "pipeline 1f1b m=4": fit(2, rows, "wide", strategy="pipeline", microbatches=4, **base),
        "tensor parallel": fit(2, rows, "wide", strategy="tensor", **base),
    }
    modelled = wide_model_bytes(batch)
    for name, figures in variants.items():
        figures["cost_model_bytes_per_step"] = modelled[name]
        print(
            f"{name}: {figures['samples_per_s']:.0f} samples/s, "
            f"{figures['bytes_sent_per_step'] / 1e6:.2f} MB a step (cost model {modelled[name] / 1e6:.2f})",
            flush=True,
        )
    return variants


def wide_model_bytes(batch: int) -> dict[str, float]:
    """What the cost model says rank 0 sends per step in each ``wide`` variant, from the wide
    model's shape (:func:`sparkdl.advisor.shape.model_shape` on a few rows)."""
    from sparkdl.advisor.costmodel import pipeline_bytes, ring_share, tensor_bytes
    from sparkdl.advisor.shape import model_shape
    from sparkdl.config import SparkDLConfig
    from sparkdl.data.tensors import Batch

    model = wide_model()
    rows = Batch({"features": torch.randn(4, WIDTH)}, torch.randint(0, 10, (4,)))
    params = sum(p.numel() for p in model.parameters())
    shapes = {
        strategy: model_shape(model, rows, SparkDLConfig().replace(num_workers=2, strategy=strategy), 2)
        for strategy in ("pipeline", "tensor")
    }
    return {
        "allreduce over gloo": ring_share(2) * 4.0 * params,
        "pipeline 1f1b m=4": pipeline_bytes(shapes["pipeline"], batch, replicas=1)[0],
        "tensor parallel": tensor_bytes(shapes["tensor"], params, batch, group=2, replicas=1),
    }


def memory(only: set[str] | None = None) -> dict[str, Any]:
    """Each worker's peak memory above its RSS before the model is built, training the
    1.0B-parameter bfloat16 model for 2 steps of 4 rows on 2 workers, SGD without momentum
    (no optimizer state): all-reduce holds the whole model and its gradients, the others
    about half. Rank 0 also gathers the final weights (a copy of the model); rank 1 is the
    figure to compare. glibc's mmap threshold is fixed at 128 KiB, so freed tensors leave
    the RSS."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # the spawned workers read it at start
    base = {
        "epochs": 1,
        "shuffle": False,
        "batch_size": 4,
        "precision": "bf16",
    }
    variants: dict[str, Any] = {}
    for name, settings in (
        ("allreduce", {}),
        ("fsdp", {"strategy": "fsdp"}),
        ("pipeline", {"strategy": "pipeline", "microbatches": 2}),
        ("tensor", {"strategy": "tensor"}),
    ):
        if only and name not in only:
            continue
        figures = fit(2, 8, "billion", **base, **settings)
        variants[name] = figures
        print(f"{name}: peak per worker {[round(g, 2) for g in figures['peak_gb']]} GB", flush=True)
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=["schedule", "wide", "memory"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--output", default="", help="default: benchmarks/results/pipeline_<part>.json")
    parser.add_argument("--only", default="", help="memory: these strategies, comma-separated (default: all)")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    parts = {"schedule": schedule, "wide": wide, "memory": lambda epochs: memory(only)}
    figures = parts[args.part](args.epochs)
    output = args.output or str(ROOT / "benchmarks" / "results" / f"pipeline_{args.part}.json")
    save_report(output, variants=figures)


if __name__ == "__main__":
    main()
