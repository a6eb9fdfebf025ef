"""Sufficient factors (issue 34): the bytes and the speed of sending wide layers' gradients
as each row's input and output gradient instead of the matrix.

    ../shared/tools/slow-net --rate 1gbit -- .venv/bin/python benchmarks/bench_factors.py

The wide MLP of bench_pipeline (64 -> 4096 -> 4096 -> 4096 -> 10, 33.9M parameters, 135 MB
of float32) with 32 rows per worker on 2 workers, all-reduce over gloo (no shared memory: the
bytes cross slow-net's link), against the same with ``sufficient_factors = "on"`` (every
Linear as factors, the narrow last one too) and ``"auto"`` (the last one, where the matrix is
smaller, stays in DDP's buckets); and the synchronous parameter server (over its sockets,
one shard) with and without factors in its pushes (its pulls are the whole weights either
way). Per variant: the bytes each worker sends (and, for the server, receives) per step and
samples/s (median of the epochs after the first), all in one run. Results:
benchmarks/results/factors.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_pipeline import fit  # noqa: E402
from benchmarks.common import save_report  # noqa: E402

#: The synchronous parameter server with its pushes and pulls over the sockets (no shared
#: memory on the driver's host), one shard: the pushes are what factors shrink.
PS = {"strategy": "parameter_server", "ps_mode": "sync", "ps_shared_memory_mb": 0, "ps_shards": 1}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=640, help="rows per worker")
    args = parser.parse_args()
    base = {"epochs": args.epochs, "shuffle": False, "batch_size": 32, "shared_memory": False}
    variants: dict[str, Any] = {}
    for name, settings in (
        ("allreduce", {}),
        ("allreduce, sufficient_factors on", {"sufficient_factors": "on"}),
        ("allreduce, sufficient_factors auto", {"sufficient_factors": "auto"}),
        ("parameter_server", PS),
        ("parameter_server, sufficient_factors auto", {**PS, "sufficient_factors": "auto"}),
    ):
        variants[name] = fit(2, args.rows, "wide", **base, **settings)
    for name, figures in variants.items():
        anchor = variants["parameter_server" if name.startswith("parameter_server") else "allreduce"]
        figures["bytes_vs_plain"] = figures["bytes_sent_per_step"] / anchor["bytes_sent_per_step"]
        figures["speed_vs_plain"] = figures["samples_per_s"] / anchor["samples_per_s"]
        figures["speed_vs_allreduce"] = figures["samples_per_s"] / variants["allreduce"]["samples_per_s"]
        speed = (
            f"{figures['speed_vs_plain']:.2f}x its plain run, {figures['speed_vs_allreduce']:.2f}x all-reduce"
        )
        sent = (
            f"{figures['bytes_sent_per_step'] / 1e6:.3f} MB a step ({figures['bytes_vs_plain']:.4f} of plain)"
        )
        received = f"{figures['bytes_received_per_step'] / 1e6:.3f} MB"
        print(
            f"{name}: {figures['samples_per_s']:.1f} samples/s ({speed}), sends {sent}, receives {received}, "
            f"loss {figures['loss']:.4f}",
            flush=True,
        )
    save_report(str(ROOT / "benchmarks" / "results" / "factors.json"), variants=variants)


if __name__ == "__main__":
    main()
