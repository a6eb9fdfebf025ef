"""Gradient averaging every step with PyTorch DDP.

DDP buckets gradients and starts each bucket's all-reduce while backward is still
running, so communication overlaps compute. With compression = "fp16" DDP's own
communication hook halves the bytes on the wire.

Every worker scales its mean loss by ``world * local_rows / global_rows``: after DDP's
mean over workers the gradient is exactly the mean over every row of the step, as
single-process SGD on the union of the workers' batches would compute, however
unevenly the rows are spread. A worker without rows steps on a zero-weight filler,
because it must join the step's all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from sparkdl.config import Compression, Strategy
from sparkdl.strategies.base import (
    StepInput,
    StrategyContext,
    SyncStrategy,
    parameter_bytes,
    ring_allreduce_bytes,
)


class AllReduceStrategy(SyncStrategy):
    """w <- w - lr * mean_i(g_i): one gradient all-reduce per step."""

    name = Strategy.ALLREDUCE
    shares_gradients = True

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        runtime = ctx.config.runtime
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # Buffers (e.g. batch-norm statistics) follow rank 0 at every forward; that is
        # DDP's default, so we leave the (version-dependent) flag alone.
        self._ddp: DistributedDataParallel | None = DistributedDataParallel(
            ctx.module,
            device_ids=device_ids,
            bucket_cap_mb=runtime.bucket_cap_mb,
            gradient_as_bucket_view=True,
        )
        bytes_per_grad = parameter_bytes(ctx.module)
        if runtime.compression is Compression.FP16:
            self._ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            bytes_per_grad //= 2
        self._step_bytes = ring_allreduce_bytes(bytes_per_grad, ctx.world_size)

    @property
    def model(self) -> nn.Module:
        return self._ddp if self._ddp is not None else self.ctx.module

    def train_step(self, step: StepInput) -> torch.Tensor:
        batches = step.batches or (step.filler(),)
        scale = self.ctx.world_size * step.rows / step.global_rows
        loss = self._backward(step, batches, scale)
        self.stats.sync_rounds += 1
        self.stats.bytes_sent += self._step_bytes
        return self._step_on_shared_gradients(step, loss)

    def close(self) -> None:
        # Drop DDP's reducer while the process group is still registered, so that the
        # group's own teardown (which joins gloo's threads) does not run inside it.
        self._ddp = None
