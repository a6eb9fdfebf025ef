"""PyTorch's PowerSGD hook, as the exchange registers it: what it sends, and its CPU copy.

PowerSGD (Vogels et al., 2019) all-reduces two low-rank factors of each gradient matrix
instead of the matrix. PyTorch ships the hook; this module prices it for the traffic
counters and gives CPU workers on a host with a GPU a copy that works there.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook


def powersgd_bytes(module: nn.Module, rank: int) -> int:
    """What PowerSGD all-reduces per step: for a matrix n x m, its factors P (n x r) and
    Q (m x r) when they are smaller than it; any other gradient whole (float32)."""
    total = 0
    for param in module.parameters():
        if not param.requires_grad:
            continue
        n = param.shape[0] if param.dim() > 1 else 0
        m = param.numel() // n if n else 0
        low_rank = n and (n + m) * rank < n * m
        total += 4 * ((n + m) * rank if low_rank else param.numel())
    return total


class _TorchWithoutCuda:
    """``torch`` as PowerSGD's CPU copy sees it: everything but ``cuda.is_available()``,
    which says False (a CPU bucket has nothing to synchronize)."""

    class _Cuda:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch.cuda, name)

        @staticmethod
        def is_available() -> bool:
            return False

    cuda = _Cuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


#: PyTorch's PowerSGD hook, its code unchanged, reading ``torch`` from globals of its own.
_powersgd_without_cuda = types.FunctionType(
    powerSGD_hook.powerSGD_hook.__code__,
    {**powerSGD_hook.powerSGD_hook.__globals__, "torch": _TorchWithoutCuda()},
    "powerSGD_hook",
    powerSGD_hook.powerSGD_hook.__defaults__,
    powerSGD_hook.powerSGD_hook.__closure__,
)


def cpu_powersgd_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's PowerSGD hook for CPU workers on a host with a GPU (``use_gpu = false`` on a
    GPU cluster). PyTorch's ends each bucket with ``torch.cuda.synchronize(bucket.device)``
    whenever CUDA is available, which raises for a CPU device ("Expected a cuda device, but
    got: cpu", seen on an H100 host; pytorch/pytorch#196568). This copy of the hook sees CUDA
    as absent; ``torch`` itself is left alone for the rest of the process."""
    future: torch.futures.Future[torch.Tensor] = _powersgd_without_cuda(state, bucket)
    return future


cpu_powersgd_hook.__annotations__ = {
    "state": powerSGD_hook.PowerSGDState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
