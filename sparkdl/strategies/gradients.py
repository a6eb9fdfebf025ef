"""Gradients summed over a group of replicas, for the model-parallel strategies (a pipeline's
stage, a tensor-parallel rank's slices) whose replicas are kept in sync outside DDP."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its local shard for a DTensor, else itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def sum_gradients(module: nn.Module, group: dist.ProcessGroup) -> int:
    """Add up every trainable parameter's gradient of ``module`` over ``group``
    (:func:`sum_parameter_gradients`)."""
    return sum_parameter_gradients([p for p in module.parameters() if p.requires_grad], group)


def sum_parameter_gradients(params: list[nn.Parameter], group: dist.ProcessGroup) -> int:
    """Add up the gradients of ``params`` (this rank's part of each) over ``group`` in one
    flat all-reduce; return the bytes this rank sent (a ring's). A parameter without a
    gradient takes part as zeros, and gets them: every rank of the group then sends the
    same layout, whichever of its parameters its own rows reached."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [local_part(p.grad) for p in params if p.grad is not None]
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    size = dist.get_world_size(group)
    return 2 * (size - 1) * flat.nbytes // size
