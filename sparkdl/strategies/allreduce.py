"""Gradient averaging every step with PyTorch DDP.

DDP buckets gradients and starts each bucket's all-reduce while backward is still
running, so communication overlaps compute. With compression = "fp16" DDP's own
communication hook halves the bytes on the wire.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from sparkdl.config import Compression, Strategy
from sparkdl.strategies.base import (
    SyncStrategy,
    WorkerContext,
    parameter_bytes,
    register,
    ring_allreduce_bytes,
)


@register
class AllReduceStrategy(SyncStrategy):
    """w <- w - lr * mean_i(g_i): one gradient all-reduce per step."""

    name = Strategy.ALLREDUCE
    shares_gradients = True

    def setup(self, module: nn.Module, ctx: WorkerContext) -> nn.Module:
        runtime = self.config.runtime
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # Buffers (e.g. batch-norm statistics) follow rank 0 at every forward; that is
        # DDP's default, so we leave the (version-dependent) flag alone.
        ddp = DistributedDataParallel(
            module,
            device_ids=device_ids,
            bucket_cap_mb=runtime.bucket_cap_mb,
            gradient_as_bucket_view=True,
        )
        bytes_per_grad = parameter_bytes(module)
        if runtime.compression is Compression.FP16:
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            bytes_per_grad //= 2
        self._step_bytes = ring_allreduce_bytes(bytes_per_grad, ctx.world_size)
        self._world_size = ctx.world_size
        return ddp

    def loss_scale(self, local_rows: int, global_rows: int) -> float:
        # DDP divides the summed gradients by the world size; this factor turns that
        # into the mean over every row of the step, however unevenly they are spread.
        return self._world_size * local_rows / global_rows

    def after_backward(self, step: int) -> None:
        self.stats.sync_rounds += 1
        self.stats.bytes_sent += self._step_bytes
