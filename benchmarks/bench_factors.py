"""Sufficient factors (issue 34): the bytes and the speed of sending wide layers' gradients
as each row's input and output gradient instead of the matrix.

    ../shared/tools/slow-net --rate 1gbit -- .venv/bin/python benchmarks/bench_factors.py

The wide MLP of bench_pipeline (64 -> 4096 -> 4096 -> 4096 -> 10, 33.9M parameters, 135 MB
of float32) with 32 rows per worker on 2 workers, all-reduce over gloo (no shared memory: the
bytes cross slow-net's link), against the same with ``sufficient_factors = "on"`` (every
Linear as factors, the narrow last one too) and ``"auto"`` (the last one, where the matrix is
smaller, stays in DDP's buckets). Per variant: the bytes each worker sends per step and
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
    ):
        variants[name] = fit(2, args.rows, "wide", **base, **settings)
    plain = variants["allreduce"]
    for name, figures in variants.items():
        figures["bytes_vs_allreduce"] = figures["bytes_sent_per_step"] / plain["bytes_sent_per_step"]
        figures["speed_vs_allreduce"] = figures["samples_per_s"] / plain["samples_per_s"]
        print(
            f"{name}: {figures['samples_per_s']:.0f} samples/s ({figures['speed_vs_allreduce']:.2f}x), "
            f"{figures['bytes_sent_per_step'] / 1e6:.2f} MB a step ({figures['bytes_vs_allreduce']:.4f}), "
            f"loss {figures['loss']:.4f}",
            flush=True,
        )
    save_report(str(ROOT / "benchmarks" / "results" / "factors.json"), variants=variants)


if __name__ == "__main__":
    main()
