"""Worker side of the parameter-server strategy: push gradients, pull weights.

The server on the driver owns the authoritative weights and runs the optimizer
(DistBelief-style), so optimizer state lives in one place; a worker only computes
gradients. Each push carries ``rows * mean gradient`` and the row count, so the
server's per-clock mean is the mean over every row of the step (exactly all-reduce
SGD in ``sync`` mode). In ``async`` mode a worker accumulates gradients for
``push_every`` steps before pushing (Downpour's n_push) and fetches fresh weights
every ``pull_every`` steps (n_fetch).

Backup workers (sync, ``backup_workers = b``). The server applies a step once ``N - b``
workers pushed it; a pull then says how many steps past the one asked for the weights
already are, and a worker that fell behind skips that many steps (it consumes their
batches and trains on none of them) instead of setting everyone's pace.

Compression. With ``compression`` set, each push is encoded with error feedback on the
worker (one residual per shard), and the server decodes it by the frame's encoding;
pulls stay float32 (the worker's copy must be the server's weights exactly).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparkdl.compression.codecs import ErrorFeedback, codec_for
from sparkdl.config import PsMode, Strategy
from sparkdl.errors import ConfigError, SparkDLError, agreed
from sparkdl.ps.client import ClientStats, PsClient
from sparkdl.strategies.base import StepInput, StrategyContext, SyncStats, SyncStrategy


class ParameterServerStrategy(SyncStrategy):
    """Gradients to the driver, weights back, by clock (sync / ssp) or as they come (async)."""

    name = Strategy.PARAMETER_SERVER

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        if ctx.ps is None:
            raise ConfigError("strategy 'parameter_server' needs a server; fit starts one on the driver")
        if self._scaler is not None:
            raise ConfigError(
                "precision = 'fp16' needs a gradient scaler next to the optimizer, and the parameter "
                "server's optimizer runs on the driver; use precision = 'bf16' with the parameter server"
            )
        settings = ctx.config.parameter_server
        self._mode = settings.ps_mode
        self._push_every = settings.push_every if self._mode is PsMode.ASYNC else 1
        self._pull_every = settings.pull_every if self._mode is PsMode.ASYNC else 1
        params = list(ctx.module.parameters())
        self._shards = [[params[i] for i in shard] for shard in ctx.ps.shard_params]
        self._accumulated = [torch.zeros(sum(p.numel() for p in s)) for s in self._shards]
        self._rows = 0
        self._version = 0
        self._skip = 0  # steps to skip: the server is already past them
        # ctx.resume_step > 0: resumed from the checkpoint of that global step; the server
        # returns to its snapshot of it, and its weights win over the checkpoint's copy.
        runtime = ctx.config.runtime
        codec = codec_for(runtime.compression, runtime.topk_ratio)
        feedback = ErrorFeedback(codec, runtime.error_feedback) if codec is not None else None
        self._client = PsClient(ctx.ps, ctx.rank, ctx.attempt, ctx.resume_step, feedback)
        try:
            self._pull(ctx.resume_step)
        except BaseException:
            self._client.close()
            raise

    def train_step(self, step: StepInput) -> torch.Tensor:
        loss = torch.zeros((), device=self.ctx.device)
        self.skipped_step = self._skip > 0
        if self.skipped_step:  # a backup worker catching up: the server applied this step without it
            self._skip -= 1
            self.stats.skipped_steps += 1
            return loss
        if step.batches:  # the optimizer runs on the server: the worker only computes gradients
            loss = self._backward(step, step.batches, 1.0)
            if self._judged_step(step, loss):
                if self._clip_norm:  # this worker's gradient (the server's shards hold no global norm)
                    torch.nn.utils.clip_grad_norm_(self.ctx.module.parameters(), self._clip_norm)
                for acc, shard in zip(self._accumulated, self._shards, strict=True):
                    acc += _flat_grad(shard) * step.rows
                self._rows += step.rows
            else:
                loss = torch.zeros((), device=self.ctx.device)
            self.ctx.optimizer.zero_grad(set_to_none=True)
        push = (step.step + 1) % self._push_every == 0
        pull = (step.step + 1) % self._pull_every == 0
        if push and pull:
            self._install(
                self._client.push_pull(
                    self._push_clock(step.step), self._rows, self._accumulated, step.step + 1
                )
            )
            self._pushed()
        elif push:
            self._push(step.step)
        elif pull:
            self._pull(step.step + 1)
        return loss

    def _stop(self, error: SparkDLError) -> None:
        """Tell the server, which fails the other workers' next pull or push; stop together."""
        self._client.abort(f"{type(error).__name__}: {error}")
        raise agreed(error)

    def checkpoint_state(self, global_step: int) -> dict[str, Any]:
        if self._rows:  # async, between pushes: send what was accumulated so it is not lost
            self._push(global_step - 1)
        return {"ps_versions": self._client.snapshot(global_step)}

    def finish(self) -> None:
        if self._rows:
            self._push(-1)

    def end_epoch(self) -> SyncStats:
        client = self._client.stats
        shard_pushes = client.pushes * len(self._shards)
        stats = SyncStats(
            sync_rounds=client.pushes,
            bytes_sent=client.bytes_sent,
            bytes_received=client.bytes_received,
            pushes=client.pushes,
            pulls=client.pulls,
            staleness_mean=client.staleness_sum / shard_pushes if shard_pushes else 0.0,
            staleness_max=client.staleness_max,
            wait_s=client.wait_s,
            skipped_steps=self.stats.skipped_steps,
            dropped_pushes=client.late_pushes if self._mode is PsMode.SYNC else 0,
        )
        self.stats = SyncStats()
        self._client.stats = ClientStats()
        return stats

    def close(self) -> None:
        self._client.close()

    def _push_clock(self, step: int) -> int:
        # sync/ssp push the clock they computed; async pushes the version it computed on
        return self._version if self._mode is PsMode.ASYNC else step

    def _push(self, step: int) -> None:
        self._client.push(self._push_clock(step), self._rows, self._accumulated)
        self._pushed()

    def _pushed(self) -> None:
        for acc in self._accumulated:
            acc.zero_()
        self._rows = 0

    def _pull(self, clock: int) -> None:
        self._install(self._client.pull(clock))

    def _install(self, results: list[tuple[int, torch.Tensor]]) -> None:
        """Copy pulled shards into the model; note how far ahead the server is."""
        self._skip = self._client.ahead
        with torch.no_grad():
            for (_, flat), shard in zip(results, self._shards, strict=True):
                offset = 0
                for p in shard:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        self._version = min(version for version, _ in results)


def _flat_grad(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
            for p in params
        ]
    )
