"""Gradient averaging every step with PyTorch DDP.

DDP buckets gradients and starts each bucket's all-reduce while backward is still
running, so communication overlaps compute. Compression is a DDP communication hook:
PyTorch's own for fp16 and PowerSGD, ours for bf16 (PyTorch's needs NCCL), 1bit and topk, which exchange each
bucket by all-gather with error feedback (:class:`sparkdl.comm.compression.collectives.CompressedAllReduce`).
With ``runtime.hierarchy`` the hook reduces each bucket within the host, all-reduces it among
the hosts' leaders and broadcasts it back (:class:`sparkdl.comm.hierarchy.HierarchicalAllReduce`).
Where every worker shares one host, the hook sums each bucket in shared memory
(:mod:`sparkdl.comm.shared_memory`), not over gloo's loopback TCP.

Every worker scales its mean loss by ``world * local_rows / global_rows``: after DDP's
mean over workers the gradient is exactly the mean over every row of the step, as
single-process SGD on the union of the workers' batches would compute, however
unevenly the rows are spread. A worker without rows steps on a zero-weight filler,
because it must join the step's all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from sparkdl.comm.compression.codecs import ErrorFeedback, OneBit, TopK
from sparkdl.comm.compression.collectives import CompressedAllReduce, bf16_allreduce_hook
from sparkdl.comm.hierarchy import HierarchicalAllReduce, hierarchical_bytes
from sparkdl.comm.shared_memory import shared_memory_hook
from sparkdl.comm.traffic import ring_allreduce_bytes
from sparkdl.config import Compression, RuntimeConfig, Strategy
from sparkdl.training.strategy import (
    StepInput,
    StrategyContext,
    SyncStrategy,
    parameter_bytes,
)


class AllReduceStrategy(SyncStrategy):
    """w <- w - lr * mean_i(g_i): one gradient all-reduce per step."""

    name = Strategy.ALLREDUCE
    shares_gradients = True

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        runtime = ctx.config.runtime
        self._compressed: CompressedAllReduce | None = None
        self._hierarchical: HierarchicalAllReduce | None = None
        self._ddp: DistributedDataParallel | None = None
        self._step_bytes = 0
        if ctx.world_size == 1:
            return  # nothing to average: the module trains as it is, without DDP's per-step cost
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # Buffers (e.g. batch-norm statistics) follow rank 0 at every forward; that is
        # DDP's default, so we leave the (version-dependent) flag alone.
        self._ddp = DistributedDataParallel(
            ctx.module,
            device_ids=device_ids,
            bucket_cap_mb=runtime.bucket_cap_mb,
            gradient_as_bucket_view=True,
        )
        self._step_bytes = self._register_hook(
            self._ddp, runtime, parameter_bytes(ctx.module), ctx.world_size
        )

    def _register_hook(
        self, ddp: DistributedDataParallel, runtime: RuntimeConfig, grad_bytes: int, world: int
    ) -> int:
        """Register the compression's hook; return the bytes a step sends (None: counted by the hook)."""
        compression = runtime.compression
        if self.ctx.hierarchy is not None:  # config refuses it with compression
            self._hierarchical = HierarchicalAllReduce(self.ctx.hierarchy, world)
            ddp.register_comm_hook(self._hierarchical, HierarchicalAllReduce.hook)
            return hierarchical_bytes(self.ctx.hierarchy, grad_bytes)
        if self.ctx.host_memory is not None:  # one host, no compression (the worker's choice)
            ddp.register_comm_hook(self.ctx.host_memory, shared_memory_hook)
            return grad_bytes  # each worker's gradients, into the shared segment
        if compression is Compression.FP16:
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            return ring_allreduce_bytes(grad_bytes // 2, world)
        if compression is Compression.BF16:
            ddp.register_comm_hook(None, bf16_allreduce_hook)
            return ring_allreduce_bytes(grad_bytes // 2, world)
        if compression is Compression.POWERSGD:
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=runtime.powersgd_rank,
                start_powerSGD_iter=2,  # DDP rebuilds its buckets after the first step
                use_error_feedback=runtime.error_feedback,
            )
            if self.ctx.device.type == "cpu" and torch.cuda.is_available():
                tolerate_cpu_synchronize()
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            return ring_allreduce_bytes(_powersgd_bytes(self.ctx.module, runtime.powersgd_rank), world)
        if compression in (Compression.ONEBIT, Compression.TOPK):
            codec = OneBit() if compression is Compression.ONEBIT else TopK(runtime.topk_ratio)
            self._compressed = CompressedAllReduce(ErrorFeedback(codec, runtime.error_feedback))
            ddp.register_comm_hook(self._compressed, CompressedAllReduce.hook)
            return 0  # the hook counts what it sends
        return ring_allreduce_bytes(grad_bytes, world)

    @property
    def model(self) -> nn.Module:
        return self._ddp if self._ddp is not None else self.ctx.module

    def train_step(self, step: StepInput) -> torch.Tensor:
        batches = step.batches or (step.filler(),)
        scale = self.ctx.world_size * step.rows / step.global_rows
        loss = self._backward(step, batches, scale)
        self.stats.sync_rounds += 1
        self.stats.bytes_sent += self._step_bytes
        if self._compressed is not None:
            self.stats.bytes_sent += self._compressed.bytes_sent
            self._compressed.bytes_sent = 0
        if self._hierarchical is not None:
            self.stats.bytes_across_hosts += self._hierarchical.bytes_across_hosts
            self._hierarchical.bytes_across_hosts = 0
        return self._step_on_shared_gradients(step, loss)

    def close(self) -> None:
        # Drop DDP's reducer while the process group is still registered, so that the
        # group's own teardown (which joins gloo's threads) does not run inside it.
        self._ddp = None
        if self._hierarchical is not None:
            self._hierarchical.close()


def tolerate_cpu_synchronize() -> None:
    """Let ``torch.cuda.synchronize(cpu_device)`` return instead of raising, process-wide.

    PyTorch's PowerSGD hook ends each bucket with ``torch.cuda.synchronize(bucket.device)``
    whenever CUDA is available, so CPU workers on a host with a GPU (``use_gpu = false``
    on a GPU cluster) fail with "Expected a cuda device, but got: cpu" (seen on an H100
    host; pytorch/pytorch#196568 proposes the fix). Synchronizing a CPU device has nothing
    to wait for; every other call reaches PyTorch's function unchanged.
    """
    original = torch.cuda.synchronize
    if getattr(original, "tolerates_cpu", False):
        return

    def synchronize(device: torch.device | str | int | None = None) -> None:
        if isinstance(device, (torch.device, str)) and torch.device(device).type == "cpu":
            return
        original(device)

    synchronize.tolerates_cpu = True  # type: ignore[attr-defined]
    torch.cuda.synchronize = synchronize


def _powersgd_bytes(module: nn.Module, rank: int) -> int:
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
