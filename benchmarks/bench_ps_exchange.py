"""The synchronous parameter server's exchange alone (issue 13, item 4): worker processes
push+pull the benchmark MLP's 85k gradients every step, optionally spinning ``--compute-ms``
first in place of training; steps/s, and CPU per step of the server's connection threads
and of each worker's exchange, through shared memory and through the sockets, alternated.

    .venv/bin/python benchmarks/bench_ps_exchange.py [--steps 2000] [--compute-ms 1.0] [--repeats 2]

It says where a step's time goes without Spark, the data feed or autograd around it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import save_report  # noqa: E402

from sparkdl.config import PsMode  # noqa: E402
from sparkdl.services.ps.client import PsClient  # noqa: E402
from sparkdl.services.ps.server import ParameterServer  # noqa: E402
from sparkdl.services.ps.store import ShardStore  # noqa: E402

PARAMS = 85_002  # the benchmark MLP 64-256-256-10


def _worker(endpoint, rank: int, steps: int, compute_ms: float, out) -> None:
    torch.set_num_threads(1)
    client = PsClient(endpoint, rank, 0)
    grads = [torch.full((PARAMS,), 1e-3)]
    client.pull(0)
    exchange_cpu, started = 0.0, time.perf_counter()
    for step in range(steps):
        end = time.perf_counter() + compute_ms / 1000
        while time.perf_counter() < end:  # stands for the step's compute
            pass
        cpu = time.thread_time()
        client.push_pull(step, 128, grads, step + 1)
        exchange_cpu += time.thread_time() - cpu
    out.put((rank, steps / (time.perf_counter() - started), client.shared_areas, exchange_cpu / steps))
    client.close()


def run(shared: bool, workers: int, steps: int, compute_ms: float) -> dict:
    torch.set_num_threads(1)
    store = ShardStore(
        [nn.Parameter(torch.zeros(PARAMS))], lambda p: torch.optim.SGD(p, lr=0.01), PsMode.SYNC, workers
    )
    threads_cpu: list[float] = []

    class Measured(ParameterServer):
        def _serve(self, *args):  # each connection thread's CPU time
            cpu = time.thread_time()
            try:
                super()._serve(*args)
            finally:
                threads_cpu.append(time.thread_time() - cpu)

    server = Measured(
        [store], "127.0.0.1", b"b" * 32, 60.0, 1 << 30, shared_memory_bytes=(1 << 24) if shared else 0
    )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    endpoint = server.endpoint(((0,),))
    procs = [ctx.Process(target=_worker, args=(endpoint, r, steps, compute_ms, out)) for r in range(workers)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    server.stop()
    return {
        "steps_per_s": min(r[1] for r in results),
        "shared_areas": [r[2] for r in results],
        "worker_exchange_cpu_us": [round(r[3] * 1e6, 1) for r in results],
        "server_thread_cpu_us_per_step": [round(c / steps * 1e6, 1) for c in threads_cpu],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--compute-ms", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", default=str(HERE / "results/ps_exchange.json"))
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"shared_memory": [], "sockets": []}
    for _ in range(args.repeats):
        for way in runs:
            runs[way].append(run(way == "shared_memory", args.workers, args.steps, args.compute_ms))
            print(way, runs[way][-1], flush=True)
    save_report(args.output, setup=vars(args), results=runs)


if __name__ == "__main__":
    main()
