"""Gradient averaging every step with PyTorch DDP.

DDP buckets gradients and starts each bucket's all-reduce while backward is still
running, so communication overlaps compute. How a bucket travels is the worker's
exchange's (:mod:`sparkdl.comm.exchange`), through DDP's communication hook: compressed
(fp16, bf16, PowerSGD, 1bit, topk with error feedback), through two levels with
``runtime.hierarchy``, or through one host's shared memory.

Every worker scales its mean loss by ``world * local_rows / global_rows``: after DDP's
mean over workers the gradient is exactly the mean over every row of the step, as
single-process SGD on the union of the workers' batches would compute, however
unevenly the rows are spread. A worker without rows steps on a zero-weight filler,
because it must join the step's all-reduce.

With ``runtime.sufficient_factors``, the fully connected layers' weight gradients leave DDP's
buckets and travel as their factors (:mod:`sparkdl.comm.factors`), gathered after backward.

Frozen parameters (``requires_grad = False``: a LoRA model's base) are in no bucket, and are
left out of DDP's starting broadcast too: every worker built the same ones
(:mod:`sparkdl.strategies.trainable`, which checks it once).

In a user's own loop the model comes back wrapped in DDP (its gradient hook the
exchange's); each parameter's gradient is scaled by ``world * rows / global_rows`` of the
running step before DDP averages it, so uneven partitions give the mean over every row of
the step, and a worker stepping on a filler (``rows = 0``) adds nothing. A model may have
several optimizers there.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sparkdl.comm.factors import Factors
from sparkdl.comm.traffic import Pattern
from sparkdl.config import SparkDLConfig, Strategy, SufficientFactors
from sparkdl.strategies.rules import refuse_compressed_hierarchy
from sparkdl.strategies.trainable import agree_on_frozen, frozen_parameters
from sparkdl.training.own_loop import OwnLoopFace, RunningStep
from sparkdl.training.strategy import (
    StepInput,
    StepOutcome,
    StrategyContext,
    SyncStrategy,
)


class AllReduceStrategy(SyncStrategy):
    """w <- w - lr * mean_i(g_i): one gradient all-reduce per step."""

    name = Strategy.ALLREDUCE
    pattern = Pattern.RING_OVERLAPPED
    shares_gradients = True
    plain_sum = True
    takes_sufficient_factors = True
    serves_own_loop = True
    optimizers_per_model = None

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self._ddp: DistributedDataParallel | None = None
        self._factors: Factors | None = None
        if ctx.world_size == 1:
            return  # nothing to average: the module trains as it is, without DDP's per-step cost
        agree_on_frozen(ctx.module, ctx.exchange, ctx.rank)
        training, mode = ctx.config.training, ctx.config.runtime.sufficient_factors
        factored: set[str] = set()
        if mode is not SufficientFactors.OFF:
            rows = training.batch_size * training.accumulate_steps
            self._factors = Factors(ctx.module, ctx.exchange, mode, rows)
            factored = set(self._factors.weight_names)
        in_buckets = [
            (n, p) for n, p in ctx.module.named_parameters() if p.requires_grad and n not in factored
        ]
        frozen = {name for name, _ in frozen_parameters(ctx.module)}
        if not in_buckets:  # every gradient travels as factors: DDP would have nothing to do
            for name, tensor in [*ctx.module.named_parameters(), *ctx.module.named_buffers()]:
                if name not in frozen:
                    ctx.exchange.broadcast_(tensor.data)  # DDP's starting broadcast
            return
        # frozen: neither in a bucket (no gradient) nor in DDP's starting broadcast
        ignored = sorted(factored | frozen)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(ctx.module, ignored)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # Buffers (e.g. batch-norm statistics) follow rank 0 at every forward; that is
        # DDP's default, so we leave the (version-dependent) flag alone.
        self._ddp = DistributedDataParallel(
            ctx.module,
            device_ids=device_ids,
            bucket_cap_mb=ctx.config.runtime.bucket_cap_mb,
            gradient_as_bucket_view=True,
        )
        bucket_bytes = sum(p.numel() * p.element_size() for _, p in in_buckets)
        ctx.exchange.attach_gradient_hook(self._ddp, bucket_bytes)

    @classmethod
    def check_settings(cls, config: SparkDLConfig) -> None:
        refuse_compressed_hierarchy(config)

    def own_loop(self, optimizer: torch.optim.Optimizer, step: RunningStep) -> OwnLoopFace:
        if self.ctx.world_size > 1:
            _scale_gradients_by_rows(self.ctx.module, step)
        return OwnLoopFace(self, optimizer, self.ctx.rank)

    @property
    def model(self) -> nn.Module:
        return self._ddp if self._ddp is not None else self.ctx.module

    def train_step(self, step: StepInput) -> StepOutcome:
        batches = step.batches or (step.filler(),)
        scale = self.ctx.world_size * step.rows / step.global_rows
        loss = self._backward(step, batches, scale)
        self.stats.sync_rounds += 1
        if self._ddp is not None:
            self.ctx.exchange.count_gradient_step()
        if self._factors is not None:
            self._factors.sum_gradients()
        return self._step_on_shared_gradients(step, loss)

    def close(self) -> None:
        # Drop DDP's reducer while the process group is still registered, so that the
        # group's own teardown (which joins gloo's threads) does not run inside it.
        self._ddp = None
        if self._factors is not None:
            self._factors.close()


def _scale_gradients_by_rows(module: nn.Module, step: RunningStep) -> None:
    """Scale each parameter's gradient by the step's share before it is averaged (a tensor
    hook runs before the gradient is accumulated, so before DDP's hook reads it). A filler's
    gradient becomes zeros, not ``0 * g``, which an infinite value would turn into NaN."""

    def scaled(grad: torch.Tensor) -> torch.Tensor | None:
        if step.scale == 1.0:
            return None
        return torch.zeros_like(grad) if step.scale == 0.0 else grad * step.scale

    for parameter in module.parameters():
        if parameter.requires_grad:
            parameter.register_hook(scaled)
