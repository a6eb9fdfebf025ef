"""Bare torchrun + DDP on the same model and data, held in memory: the ceiling for fit.

    torchrun --nproc_per_node 2 benchmarks/ddp_baseline.py --rows 200000 --epochs 4 --batch-size 128
Prints one JSON line (from rank 0) with samples/s over epochs 2+.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_data, make_model, make_optimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    x, y = make_data(args.rows)
    shard = slice(rank * len(y) // world, (rank + 1) * len(y) // world)
    x, y = torch.from_numpy(x[shard]), torch.from_numpy(y[shard])
    torch.manual_seed(0)
    model = DistributedDataParallel(make_model())
    optimizer = make_optimizer(model.parameters())
    timings = []
    for epoch in range(args.epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        dist.barrier()
        started = time.perf_counter()
        for start in range(0, len(y), args.batch_size):
            idx = order[start : start + args.batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        dist.barrier()
        timings.append(time.perf_counter() - started)
    if rank == 0:
        later = timings[1:]
        print(json.dumps({"samples_per_s": args.rows * len(later) / sum(later), "epoch_seconds": timings}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
