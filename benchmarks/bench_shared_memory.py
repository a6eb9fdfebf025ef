"""Gradient exchange between the workers of one host: gloo's loopback TCP against shared memory.

    .venv/bin/python benchmarks/bench_shared_memory.py [--workers 2] [--steps 300] [--repeats 5]

Two measurements in the same spawned worker processes, blocks alternated ``--repeats``
times (medians), so both ways see the same machine:

- a DDP training step of the benchmark MLP (benchmarks/common.py, batch 128, one torch
  thread per worker): DDP's default gloo all-reduce against sparkdl's shared-memory hook
  (:func:`sparkdl.comm.shared_memory.shared_memory_hook`), and the same step with no
  exchange at all (the compute's floor);
- a bare all-reduce of 1 float, the MLP's 85k floats, 1M and 10M floats.

Results: benchmarks/results/shared_memory.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import make_data, make_model, make_optimizer, save_report  # noqa: E402

BATCH = 128
SIZES = (1, 85_002, 1_000_000, 10_000_000)  # 85,002: the MLP's parameters


def _step_loop(model: Any, optimizer: Any, x: Any, y: Any, steps: int) -> float:
    import torch

    started = time.perf_counter()
    for i in range(steps):
        start = (i * BATCH) % (len(y) - BATCH)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(
            model(x[start : start + BATCH]), y[start : start + BATCH]
        ).backward()
        optimizer.step()
    return (time.perf_counter() - started) / steps


def _all_reduce_time(reduce: Any, tensor: Any, repeats: int) -> float:
    reduce(tensor)  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        reduce(tensor)
    return (time.perf_counter() - started) / repeats


def _worker(rank: int, world: int, init: str, steps: int, repeats: int, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sparkdl.comm.shared_memory import form_host_group, shared_memory_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    host = form_host_group(rank, world, None, 4 * max(SIZES), 60.0)
    assert host is not None, "no shared memory on this machine"
    x, y = (torch.from_numpy(a) for a in make_data(BATCH * 200, seed=rank))
    ways: dict[str, Any] = {}
    for name in ("gloo", "shared_memory", "no_exchange"):
        torch.manual_seed(0)
        module = make_model()
        if name != "no_exchange":
            module = DistributedDataParallel(module, gradient_as_bucket_view=True)
        if name == "shared_memory":
            module.register_comm_hook(host, shared_memory_hook)
        ways[name] = (module, make_optimizer(module.parameters()))
    step_s: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, (module, optimizer) in ways.items():
            dist.barrier()
            step_s[name].append(_step_loop(module, optimizer, x, y, steps))
    reduce_s: dict[str, dict[str, list[float]]] = {}
    for size in SIZES:
        tensor = torch.ones(size)
        times: dict[str, list[float]] = {"gloo": [], "shared_memory": []}
        count = max(5, min(300, 30_000_000 // (size * 4)))
        for _ in range(repeats):
            dist.barrier()
            times["gloo"].append(_all_reduce_time(dist.all_reduce, tensor, count))
            dist.barrier()
            times["shared_memory"].append(_all_reduce_time(host.all_reduce_, tensor, count))
        reduce_s[str(size)] = times
    host.close()
    dist.destroy_process_group()
    out.put((rank, step_s, reduce_s))


def _medians_ms(runs: dict[str, list[float]]) -> dict[str, float]:
    return {name: round(1e3 * statistics.median(times), 3) for name, times in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/shared_memory.json"))
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file:///tmp/sparkdl-bench-shm-{os.getpid()}"
    procs = [
        ctx.Process(target=_worker, args=(r, args.workers, init, args.steps, args.repeats, out))
        for r in range(args.workers)
    ]
    for p in procs:
        p.start()
    results = dict((rank, (steps, reduces)) for rank, steps, reduces in (out.get(timeout=900) for _ in procs))
    for p in procs:
        p.join(60)
    step_s, reduce_s = results[0]
    step = _medians_ms(step_s)
    save_report(
        args.output,
        setup={
            "workers": args.workers,
            "steps_per_block": args.steps,
            "repeats": args.repeats,
            "batch": BATCH,
        },
        step_ms=step,
        step_ms_every_block={name: [round(1e3 * t, 3) for t in times] for name, times in step_s.items()},
        step_speedup=round(step["gloo"] / step["shared_memory"], 2),
        exchange_ms={
            "gloo": round(step["gloo"] - step["no_exchange"], 3),
            "shared_memory": round(step["shared_memory"] - step["no_exchange"], 3),
        },
        all_reduce_ms={size: _medians_ms(times) for size, times in reduce_s.items()},
    )


if __name__ == "__main__":
    main()
