"""Rows moved between the workers of a group, for the model-parallel strategies (a
pipeline's stages, a tensor-parallel group): how many each holds, and padding to a common
count (a collective of tensors needs the same shape on every rank)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def row_counts(rows: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """Every worker of ``group``'s ``rows``, in the group's order (on ``device``: NCCL's too)."""
    mine = torch.tensor([rows], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(c) for c in every]


def padded(tensor: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """``tensor`` with zero rows added up to the largest of ``counts``."""
    most = max(counts)
    if len(tensor) >= most:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((most - len(tensor), *tensor.shape[1:]))])
