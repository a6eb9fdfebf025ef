"""Weight averaging every ``sync_every`` local steps (SparkNet; "local SGD").

Each worker trains its own copy of the model on its own partition with no
communication at all; every ``tau = sync_every`` steps the workers average
parameters, floating-point buffers (batch-norm running statistics) and, by default,
the optimizer state (momentum, Adam moments) in one bucketed all-reduce. A final
average at the end of training leaves every worker, and the returned model, with
the same weights.

Averaging weights. Each worker's contribution is weighted by the rows it trained on
since the previous average: ``w <- sum_i n_i w_i / sum_i n_i``. A worker whose
partition ran out (or was empty) has ``n_i = 0`` and simply receives the average,
so it never drags the model back toward stale weights. With plain SGD, tau = 1 and
full batches this is exactly gradient averaging: ``sum_i n_i (w - lr g_i) / n =
w - lr * (mean gradient over all rows)``; with momentum and averaged optimizer
state it still is, because the momentum update is linear too.

Optimizer state. With ``average_optimizer_state = true`` (default) every floating
tensor in ``optimizer.state`` is averaged as well, once every worker holds it (a
worker that has not stepped yet has no momentum buffer). Integer or scalar
bookkeeping (Adam's step count) is the same on every worker and left alone. With
``false`` each worker keeps its own optimizer state; only weights and buffers move.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from sparkdl.config import Strategy
from sparkdl.errors import PeerStopped, SparkDLError, agreed
from sparkdl.strategies.base import SyncStrategy, WorkerContext, register, ring_allreduce_bytes


@register
class WeightAveragingStrategy(SyncStrategy):
    """w <- weighted mean_i(w_i) every ``sync_every`` steps; no traffic in between."""

    name = Strategy.WEIGHT_AVERAGING
    steps_without_data = False

    def setup(self, module: nn.Module, ctx: WorkerContext) -> nn.Module:
        self._module = module
        self._ctx = ctx
        self._optimizer: torch.optim.Optimizer | None = None
        self._tau = self.config.training.sync_every
        self._bucket_bytes = int(self.config.runtime.bucket_cap_mb * 1024 * 1024)
        self._rows_since_sync = 0
        self._stopping: SparkDLError | None = None
        self._steps_since_sync = 0
        for tensor in self._model_tensors():  # start from rank 0's weights, like DDP
            dist.broadcast(tensor, src=0)
        return module

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def loss_scale(self, local_rows: int, global_rows: int) -> float:
        return 1.0  # every worker steps on its own mean loss

    def after_step(self, step: int, local_rows: int) -> None:
        self._rows_since_sync += local_rows
        self._steps_since_sync += 1
        if (step + 1) % self._tau == 0:
            self._average()

    def finish(self) -> None:
        if self._steps_since_sync:
            self._average()

    def stop(self, error: SparkDLError) -> None:
        self._stopping = error  # raised on every rank at the next average

    def _average(self) -> None:
        # One small all-reduce carries the rows of this round and which ranks must stop.
        message = torch.zeros(1 + self._ctx.world_size, dtype=torch.float64, device=self._ctx.device)
        message[0] = float(self._rows_since_sync)
        message[1 + self._ctx.rank] = 1.0 if self._stopping is not None else 0.0
        dist.all_reduce(message)
        values = message.tolist()
        stopped = [rank for rank, flag in enumerate(values[1:]) if flag]
        if stopped:
            raise agreed(
                self._stopping
                or PeerStopped(f"rank {self._ctx.rank} stopped with rank(s) {stopped}, which failed")
            )
        tensors = list(self._model_tensors())
        if self._include_optimizer_state():
            tensors += list(self._optimizer_tensors())
        total = values[0]
        if total > 0:
            self._weighted_all_reduce(tensors, self._rows_since_sync / total)
        self.stats.sync_rounds += 1
        self.stats.bytes_sent += ring_allreduce_bytes(
            sum(t.numel() * t.element_size() for t in tensors), self._ctx.world_size
        )
        self._rows_since_sync = self._steps_since_sync = 0

    def _weighted_all_reduce(self, tensors: list[torch.Tensor], own_weight: float) -> None:
        """sum_i own_weight_i * t_i, in buckets of ``bucket_cap_mb`` all-reduced concurrently."""
        pending = []
        for bucket in _buckets(tensors, self._bucket_bytes):
            flat = torch.cat([t.detach().reshape(-1) for t in bucket]).mul_(own_weight)
            pending.append((bucket, flat, dist.all_reduce(flat, async_op=True)))
        for bucket, flat, work in pending:
            assert work is not None
            work.wait()
            offset = 0
            with torch.no_grad():
                for tensor in bucket:
                    tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()

    def _model_tensors(self) -> Iterator[torch.Tensor]:
        yield from (p.data for p in self._module.parameters())
        yield from (b for b in self._module.buffers() if b.is_floating_point())

    def _optimizer_tensors(self) -> Iterator[torch.Tensor]:
        assert self._optimizer is not None
        for group in self._optimizer.param_groups:
            for param in group["params"]:
                state = self._optimizer.state.get(param, {})
                for key in sorted(state):
                    value = state[key]
                    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                        yield value

    def _include_optimizer_state(self) -> bool:
        """True when state is averaged and every worker holds the same set of state tensors."""
        if not self.config.training.average_optimizer_state or self._optimizer is None:
            return False
        count = sum(t.numel() for t in self._optimizer_tensors())
        agreed = torch.tensor([count, -count], dtype=torch.float64, device=self._ctx.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return count > 0 and agreed[0].item() == count and -agreed[1].item() == count


def _buckets(tensors: list[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive groups of tensors of the same dtype and device, each under ``cap_bytes``."""
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        compatible = not bucket or (tensor.dtype == bucket[0].dtype and tensor.device == bucket[0].device)
        if bucket and (size + nbytes > cap_bytes or not compatible):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket
