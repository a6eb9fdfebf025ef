"""Worker side of the parameter-server strategy: push gradients, pull weights.

The server on the driver owns the authoritative weights and runs the optimizer
(DistBelief-style), so optimizer state lives in one place; a worker only computes
gradients. Each push carries ``rows * mean gradient`` and the row count, so the
server's per-clock mean is the mean over every row of the step (exactly all-reduce
SGD in ``sync`` mode). In ``async`` mode a worker accumulates gradients for
``push_every`` steps before pushing (Downpour's n_push) and fetches fresh weights
every ``pull_every`` steps (n_fetch).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparkdl.config import PsMode, SparkDLConfig, Strategy
from sparkdl.errors import ConfigError, SparkDLError, agreed
from sparkdl.ps.client import ClientStats, PsClient
from sparkdl.ps.server import PsEndpoint
from sparkdl.strategies.base import SyncStats, SyncStrategy, WorkerContext, register


@register
class ParameterServerStrategy(SyncStrategy):
    """Gradients to the driver, weights back, by clock (sync / ssp) or as they come (async)."""

    name = Strategy.PARAMETER_SERVER
    steps_without_data = False
    applies_updates = True

    def __init__(
        self, config: SparkDLConfig, ps: PsEndpoint | None = None, attempt: int = 0, start_step: int = 0
    ) -> None:
        super().__init__(config)
        if ps is None:
            raise ConfigError("strategy 'parameter_server' needs a server; fit starts one on the driver")
        self._endpoint = ps
        self._attempt = attempt
        self._start_step = start_step  # > 0: resumed from the checkpoint of this global step
        training = config.training
        self._mode = training.ps_mode
        self._push_every = training.push_every if self._mode is PsMode.ASYNC else 1
        self._pull_every = training.pull_every if self._mode is PsMode.ASYNC else 1
        self._client: PsClient | None = None

    def setup(self, module: nn.Module, ctx: WorkerContext) -> nn.Module:
        params = list(module.parameters())
        self._shards = [[params[i] for i in shard] for shard in self._endpoint.shard_params]
        self._client = PsClient(self._endpoint, ctx.rank, self._attempt, self._start_step)
        self._accumulated = [torch.zeros(sum(p.numel() for p in s)) for s in self._shards]
        self._rows = 0
        self._version = 0
        self._pull(self._start_step)
        return module

    def loss_scale(self, local_rows: int, global_rows: int) -> float:
        return 1.0

    def after_step(self, step: int, local_rows: int) -> None:
        if local_rows:
            for acc, shard in zip(self._accumulated, self._shards, strict=True):
                acc += _flat_grad(shard) * local_rows
            self._rows += local_rows
        if (step + 1) % self._push_every == 0:
            self._push(step)
        if (step + 1) % self._pull_every == 0:
            self._pull(step + 1)

    def stop(self, error: SparkDLError) -> None:
        """Tell the server, which fails the other workers' next pull or push; stop together."""
        assert self._client is not None
        self._client.abort(f"{type(error).__name__}: {error}")
        raise agreed(error)

    def checkpoint_state(self, global_step: int) -> dict[str, Any]:
        assert self._client is not None
        if self._rows:  # async, between pushes: send what was accumulated so it is not lost
            self._push(global_step - 1)
        return {"ps_versions": self._client.snapshot(global_step)}

    def finish(self) -> None:
        if self._rows:
            self._push(-1)

    def end_epoch(self) -> SyncStats:
        assert self._client is not None
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
        )
        self._client.stats = ClientStats()
        return stats

    def teardown(self) -> None:
        if self._client is not None:
            self._client.close()

    def _push(self, step: int) -> None:
        assert self._client is not None
        # sync/ssp push the clock they computed; async pushes the version it computed on
        clock = self._version if self._mode is PsMode.ASYNC else step
        self._client.push(clock, self._rows, self._accumulated)
        for acc in self._accumulated:
            acc.zero_()
        self._rows = 0

    def _pull(self, clock: int) -> None:
        assert self._client is not None
        results = self._client.pull(clock)
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
