"""fsdp's checkpoint written by its owners against gathered to rank 0 (issue 56 item 1), for a
100M-parameter model (ten Linear layers, fp32) with Adam's state, on 2 ranks (gloo on
loopback, one process each), to local disk.

Gathered: what fsdp's checkpoints were until session 36: the whole model and optimizer state
gathered to rank 0 (``get_*_state_dict(full_state_dict=True, cpu_offload=True)``), then
``torch.save`` into memory and the file written (fsync and rename) through
:class:`~sparkdl.storage.checkpoint_store.CheckpointStore`. Owners: each rank writes its own
shards (:func:`sparkdl.storage.sharded.save`), then rank 0 the small checkpoint file.
Background (session 37, what fit does): each rank copies its shards into host memory
(:func:`sparkdl.storage.sharded.stage`) and its store's thread writes them, then rank 0's the
file (:meth:`~sparkdl.storage.checkpoint_store.CheckpointStore.save_sharded`). For each: how
long every rank is held (the slowest rank's time), for the background kind also until the
write ended, and rank 0's peak resident memory over its resident memory before the write.

    .venv/bin/python benchmarks/bench_sharded_checkpoint.py [--params 100e6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import save_report  # noqa: E402

LAYERS = 10


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _rank(rank: int, world: int, port: int, params: float, repeats: int, folder: str, out) -> None:  # type: ignore[no-untyped-def]
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from sparkdl.storage import sharded
    from sparkdl.storage.checkpoint_store import CheckpointStore
    from sparkdl.strategies.distributed_state import GATHER, own_parts

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    width = int(math.sqrt(params / LAYERS))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(LAYERS)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    checkpoints = CheckpointStore(folder, background=True)
    writers = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))
    kinds = ("gathered", "owners", "background")
    figures: dict[str, list[float]] = {f"{k}_{figure}": [] for k in kinds for figure in ("s", "peak_mb")}
    figures["background_written_s"] = []
    for repeat in range(repeats):
        for kind in kinds:
            dist.barrier()
            _reset_peak()
            before = _kib("VmRSS")
            started = time.perf_counter()
            step = len(kinds) * repeat + kinds.index(kind)
            if kind == "gathered":
                whole = get_model_state_dict(model, options=GATHER)
                moments = get_optimizer_state_dict(model, optimizer, options=GATHER)
                if rank == 0:
                    checkpoints.save(step, {"format": 1, "model": whole, "optimizer": moments})
                del whole, moments
            elif kind == "owners":
                if rank == 0:
                    checkpoints.retract(step)
                sharded.save(own_parts(model, optimizer), checkpoints.shards_for(step))
                if rank == 0:
                    checkpoints.save(step, {"format": 1, "model": {}, "optimizer": {}, "shards": "x"})
            else:
                if rank == 0:
                    checkpoints.retract(step)
                location = checkpoints.shards_for(step)
                staged = sharded.stage(own_parts(model, optimizer))
                state = {"format": 1, "model": {}, "optimizer": {}, "shards": "x"} if rank == 0 else None
                write = functools.partial(sharded.save, staged, location, {}, writers)
                checkpoints.save_sharded(step, write, state)
                del staged, write  # the store's thread holds the copy until it is written
            held = torch.tensor([time.perf_counter() - started])
            if kind == "background":
                checkpoints.flush()
                written = torch.tensor([time.perf_counter() - started])
                dist.all_reduce(written, op=dist.ReduceOp.MAX)
                figures["background_written_s"].append(written.item())
            dist.all_reduce(held, op=dist.ReduceOp.MAX)
            figures[f"{kind}_s"].append(held.item())
            figures[f"{kind}_peak_mb"].append((_kib("VmHWM") - before) / 1024)
    if rank == 0:
        out.put(figures)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        procs = [
            ctx.Process(target=_rank, args=(r, 2, port, args.params, args.repeats, folder, out))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        figures = out.get(timeout=1800)
        for p in procs:
            p.join(60)
    report = {key: statistics.median(values) for key, values in figures.items()}
    report |= {"params": args.params, "repeats": args.repeats, "ranks": 2}
    save_report(str(ROOT / "benchmarks/results/sharded_checkpoint.json"), results=report)


if __name__ == "__main__":
    main()
