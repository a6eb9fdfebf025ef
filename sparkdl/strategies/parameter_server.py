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
worker (one residual per shard), and the server decodes it by the frame's encoding.
Pulls are float32 unless ``ps_pull_precision = "bf16"``: then the server sends its weights
rounded to bf16 (half the bytes of its busiest direction) and the worker computes on them;
the server's own weights, and so the trained model, stay float32, and every pull rounds
afresh, so no rounding error accumulates (no error feedback needed).

Shared memory. A worker on the driver's own host (local mode, a single-node cluster) pushes
and pulls through the server's shared memory (``ps_shared_memory_mb``, :mod:`sparkdl.comm.ps_areas`):
only the frames' authenticated headers cross its socket, and its traffic never counts as
crossing hosts.

Frozen parameters (``requires_grad = False``: a LoRA model's base) are not served: the
driver's shards hold and update only the trainable ones (:mod:`sparkdl.services.ps.sharding`),
each worker keeps the frozen weights its ``model_fn`` built, the same on every worker
(:mod:`sparkdl.strategies.trainable`, checked once at build time), and the model returned to
the driver is the server's trainable weights over rank 0's frozen ones and buffers.

Hierarchy (``runtime.hierarchy``; MXNet's level-1 servers). Only each host's leader talks to
the driver: the host's workers sum their gradients and rows into the leader
(:class:`sparkdl.comm.hierarchy.HostGroups`), the leader pushes the host's sum as pusher
number ``host`` of ``hosts`` and pulls, and broadcasts the weights to its host. The driver's
traffic falls by the workers per host, and in sync mode the answer is unchanged: the
server's mean is still over every row of the step. A worker that must stop says so in the
host's next sum; its leader aborts the server and tells the host.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparkdl.comm.compression.codecs import ErrorFeedback, codec_for
from sparkdl.comm.ps_endpoint import PsEndpoint
from sparkdl.comm.traffic import Pattern
from sparkdl.config import (
    Compression,
    Precision,
    PsMode,
    SparkDLConfig,
    Strategy,
    SufficientFactors,
)
from sparkdl.errors import ConfigError, PeerStopped, SparkDLError, TrainingFailedError, agreed
from sparkdl.services.ps.client import ClientStats, PsClient
from sparkdl.strategies.ps_factors import FactorPushes
from sparkdl.strategies.ps_own_loop import ServedFace, check_served_model, check_served_settings
from sparkdl.strategies.rules import refuse_backups_without_a_worker, refuse_powersgd
from sparkdl.strategies.trainable import agree_on_frozen
from sparkdl.training.own_loop import OwnLoopFace, RunningStep
from sparkdl.training.strategy import (
    StepInput,
    StepOutcome,
    StrategyContext,
    SyncStats,
    SyncStrategy,
    Verdict,
)


class ParameterServerStrategy(SyncStrategy):
    """Gradients to the driver, weights back, by clock (sync / ssp) or as they come (async)."""

    name = Strategy.PARAMETER_SERVER
    resizes = False
    pattern = Pattern.STAR
    takes_sufficient_factors = True
    hosted_on_driver = True
    serves_own_loop = True
    steps_together = False

    @classmethod
    def check_settings(cls, config: SparkDLConfig) -> None:
        refuse_backups_without_a_worker(
            config,
            "backup_workers",
            config.parameter_server.backup_workers,
            "each step is made by the first num_workers - backup_workers pushes, so at least one",
            "with a hierarchy the hosts' leaders push, not the workers; set backup_workers = 0",
        )
        if config.training.precision is Precision.FP16:
            raise ConfigError(
                "precision = 'fp16' needs a gradient scaler next to the optimizer, and the parameter "
                "server's optimizer runs on the driver; use precision = 'bf16' with the parameter server"
            )
        refuse_powersgd(config)
        if not config.parameter_server.ps_barrier:
            refuse_for_independent_tasks(config)
        factors, compression = config.runtime.sufficient_factors, config.runtime.compression
        if factors is not SufficientFactors.OFF and compression is not Compression.NONE:
            raise ConfigError(
                f"sufficient_factors = {factors.value!r} with compression = {compression.value!r}: a "
                "parameter server's push is either compressed or carries factors; choose one of them"
            )

    @classmethod
    def check_own_loop_settings(cls, config: SparkDLConfig) -> None:
        check_served_settings(config)

    @classmethod
    def check_own_loop_model(cls, module: nn.Module, ps: PsEndpoint | None) -> None:
        check_served_model(module, ps)

    def own_loop(self, optimizer: torch.optim.Optimizer, step: RunningStep) -> OwnLoopFace:
        ctx = self.ctx
        return ServedFace(self, optimizer, step, ctx.rank, ctx.world_size, ctx.control_group)

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        if ctx.ps is None:
            raise ConfigError("strategy 'parameter_server' needs a server; fit starts one on the driver")
        settings = ctx.config.parameter_server
        # an independent task pushes as it comes, under ssp too (every step): the server holds
        # its pull while its partition is more than staleness pushes past the slowest live one
        self._mode = PsMode.ASYNC if ctx.ps.partition >= 0 else settings.ps_mode
        self._push_every = settings.push_interval
        self._pull_every = settings.pull_every if settings.ps_mode is PsMode.ASYNC else 1
        params = list(ctx.module.parameters())
        check_served_model(ctx.module, ctx.ps)  # the server's shards are this model's trainable parameters
        agree_on_frozen(ctx.module, ctx.exchange, ctx.rank)  # which the workers keep: the same everywhere
        self._shards = [[params[i] for i in shard] for shard in ctx.ps.shard_params]
        self._sizes = [sum(p.numel() for p in s) for s in self._shards]  # flat values per shard
        self._accumulated = [torch.zeros(n) for n in self._sizes]
        self._factors: FactorPushes | None = None
        if ctx.config.runtime.sufficient_factors is not SufficientFactors.OFF:
            self._factors = FactorPushes(ctx.module, self._shards)
        self._rows = 0
        self._version = 0
        self._skip = 0  # steps to skip: the server is already past them
        # ctx.resume_step > 0: resumed from the checkpoint of that global step; the server
        # returns to its snapshot of it, and its weights win over the checkpoint's copy.
        runtime = ctx.config.runtime
        codec = codec_for(runtime.compression, runtime.topk_ratio)
        feedback = ErrorFeedback(codec, runtime.error_feedback) if codec is not None else None
        self._hierarchy = ctx.exchange.hierarchy  # its leaders alone talk to the server
        self._stopping: SparkDLError | None = None  # hierarchy: told to the leader at the next push
        self._client: PsClient | None = None
        bf16 = settings.ps_pull_precision is Precision.BF16
        self._skip_rows = 0  # independent tasks: rows of this partition the server already applied
        self._independent = ctx.ps.partition >= 0
        if self._independent:  # an independent task: pushes as its partition, fenced by its task id
            self._client = PsClient(
                ctx.ps, ctx.ps.partition, ctx.ps.task_attempt, 0, feedback, bf16_pulls=bf16
            )
            self._skip_rows = self._client.rows_done or 0
        elif self._hierarchy is None:
            self._client = PsClient(ctx.ps, ctx.rank, ctx.attempt, ctx.resume_step, feedback, bf16_pulls=bf16)
        elif self._hierarchy.is_leader:  # pusher number `host` of `hosts`
            h = self._hierarchy
            self._client = PsClient(
                ctx.ps, h.host, ctx.attempt, ctx.resume_step, feedback, pushers=h.hosts, bf16_pulls=bf16
            )
        try:
            self._exchange(None, ctx.resume_step)
        except BaseException:
            self.close()
            raise

    def train_step(self, step: StepInput) -> StepOutcome:
        loss = torch.zeros((), device=self.ctx.device)
        if self._skip > 0:  # a backup worker catching up: the server applied this step without it
            self._skip -= 1
            self.stats.skipped_steps += 1
            return StepOutcome(loss, trained=False)
        if self._skip_rows > 0:  # an independent task's retry: its predecessor's pushes hold these rows
            return self._skip_applied(step)
        verdict = Verdict.APPLY
        if step.batches:  # the optimizer runs on the server: the worker only computes gradients
            loss = self._backward(step, step.batches, 1.0)
            verdict = self._judge(step, loss)
            if verdict is Verdict.APPLY:
                self._refuse_shared_factors()
                clipped = 1.0
                if self._clip_norm:  # this worker's gradient (the server's shards hold no global norm)
                    norm = torch.nn.utils.clip_grad_norm_(self.ctx.module.parameters(), self._clip_norm)
                    clipped = min(1.0, self._clip_norm / (float(norm) + 1e-6))  # as clip_grad_norm_ scaled
                if self._factors is not None:
                    self._factors.add(step.rows * clipped)
                self.add_gradients(step.rows)
            else:
                loss = torch.zeros((), device=self.ctx.device)
                self._clear_gradients()
                if self._factors is not None:
                    self._factors.drop()
                if self._independent and self._client is not None:
                    self._client.rows_dropped += step.rows  # covered all the same: a retry skips them
        self.step_done(step.step)
        return StepOutcome(loss, nan_skipped=verdict is Verdict.NAN_SKIPPED)

    def _skip_applied(self, step: StepInput) -> StepOutcome:
        """Skip a step whose rows an earlier attempt of this partition pushed (the server
        applied them); its batches are read, nothing is computed or pushed.

        Raises:
            TrainingFailedError: the step holds more rows than are left to skip: this attempt's
                batches are not its predecessor's (the partition's rows came in another order
                or number), so exactly-once per epoch cannot hold.
        """
        if step.rows > self._skip_rows:
            raise TrainingFailedError(
                f"partition {self.ctx.ps.partition if self.ctx.ps else -1}: task "
                f"{self.ctx.ps.task_attempt if self.ctx.ps else 0} resumes after rows its predecessor's "
                f"pushes covered, but its step {step.step} holds {step.rows} rows with only "
                f"{self._skip_rows} left to skip: the partition's rows are not read as they were (a "
                "non-deterministic input: sort it, or cache or checkpoint the DataFrame before fit)"
            )
        self._skip_rows -= step.rows
        self.stats.skipped_steps += 1
        return StepOutcome(torch.zeros((), device=self.ctx.device), trained=False)

    def _refuse_shared_factors(self) -> None:
        """Stop every worker (through the server) when a factored weight is used outside its
        layer: its factors would drop that share of its gradient."""
        shared = self._factors.used_elsewhere() if self._factors is not None else []
        if shared:
            self._stop(
                ConfigError(
                    f"sufficient_factors: the weight of {shared} is used outside its nn.Linear (a "
                    "function of it in the forward, or a tie), so its gradient is not its rows' "
                    "factors; set sufficient_factors = 'off', or use the weight only through its layer"
                )
            )

    def add_gradients(self, rows: int) -> None:
        """Add the model's gradients (of a mean loss over ``rows`` rows) to what the next push
        sends, weighted by ``rows``, and clear them: the optimizer steps on the server. A user's
        own loop calls it for its optimizer's step (:mod:`sparkdl.strategies.ps_own_loop`)."""
        for acc, shard in zip(self._accumulated, self._shards, strict=True):
            acc.add_(_flat_grad(shard), alpha=rows)
        self._rows += rows
        self._clear_gradients()

    def step_done(self, step: int) -> None:
        """Global step ``step`` is over on this worker: push what it added and/or pull the
        weights, as the mode says (sync: both, every step, rows or none)."""
        push = (step + 1) % self._push_every == 0
        pull = (step + 1) % self._pull_every == 0
        if push or pull:
            self._exchange(step if push else None, step + 1 if pull else None)

    def _clear_gradients(self) -> None:
        for shard in self._shards:
            for p in shard:
                p.grad = None

    def _stop(self, error: SparkDLError) -> None:
        """Tell the server, which fails the other workers' next pull or push; stop together.
        In a hierarchy a member tells its leader, in the host's next sum."""
        if self._hierarchy is not None:
            self._stopping = error
            return
        assert self._client is not None
        self._client.abort(f"{type(error).__name__}: {error}")
        raise agreed(error)

    def checkpoint_state(self, global_step: int) -> dict[str, Any]:
        # rank 0 alone (it leads its host): async, between pushes, its own accumulated rows
        # go now so that they are not lost; a hierarchy's members send theirs at the next push
        assert self._client is not None, "rank 0 always holds a client"
        if self._rows:
            self._client.push(self._push_clock(global_step - 1), self._rows, self._accumulated)
            self._pushed()
        return {"ps_versions": self._client.snapshot(global_step)}

    def finish(self) -> None:
        if self._hierarchy is not None:  # every rank of a host joins the sum, rows or none
            if self._mode is PsMode.ASYNC and self._push_every > 1:
                self._exchange(-1, None)
        elif self._rows or (self._client is not None and self._client.rows_dropped):
            self._exchange(-1, None)

    def settle(self, steps: int) -> None:
        """Pull the server's final weights, once every worker's :meth:`finish` returned (the
        caller's barrier between): a user's own loop, whose workers each end holding the model
        the server trained. ``steps``: the clocks of the run. In ``sync`` mode the last pull
        already brought them; ``ssp`` waits for every clock to be applied; ``async`` pulls
        what the server holds now, every push being in."""
        if self._mode is PsMode.SYNC:
            return
        staleness = self.ctx.config.parameter_server.staleness if self._mode is PsMode.SSP else 0
        self._exchange(None, steps + staleness)

    def end_epoch(self) -> SyncStats:
        if self._client is None:  # a hierarchy's member: its traffic stays on its host
            stats = SyncStats(
                sync_rounds=self.stats.sync_rounds,
                bytes_sent=self.stats.bytes_sent,
                skipped_steps=self.stats.skipped_steps,
            )
            self.stats = SyncStats()
            return stats
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
            bytes_across_hosts=client.bytes_sent - client.shared_sent,  # to the driver's host
        )
        if self._hierarchy is not None:  # and what it sent its host: the weights, to each member
            stats.bytes_sent += self.stats.bytes_sent
        self.stats = SyncStats()
        self._client.stats = ClientStats()
        return stats

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._factors is not None:
            self._factors.close()

    def _push_clock(self, step: int) -> int:
        # sync/ssp push the clock they computed; async pushes the version it computed on
        return self._version if self._mode is PsMode.ASYNC else step

    def _exchange(self, push_step: int | None, pull_clock: int | None) -> None:
        """Push what was accumulated (as of ``push_step``) and/or pull the weights for
        ``pull_clock``: straight with the server, or through the host's leader."""
        if self._hierarchy is not None:
            self._exchange_in_host(push_step, pull_clock)
            return
        results = self._to_server(push_step, pull_clock, self._rows, self._accumulated)
        if push_step is not None:
            self._pushed()
        if results is not None:
            assert self._client is not None
            self._install(results, self._client.ahead)

    def _to_server(
        self, push_step: int | None, pull_clock: int | None, rows: int, grads: list[torch.Tensor]
    ) -> list[tuple[int, torch.Tensor]] | None:
        """One push and/or pull with the server (one round trip for both); the pulled shards."""
        assert self._client is not None
        pushes = grads if self._factors is None or push_step is None else self._factors.encode(grads)
        if push_step is not None and pull_clock is not None:
            return self._client.push_pull(self._push_clock(push_step), rows, pushes, pull_clock)
        if push_step is not None:
            self._client.push(self._push_clock(push_step), rows, pushes)
            return None
        assert pull_clock is not None
        return self._client.pull(pull_clock)

    def _exchange_in_host(self, push_step: int | None, pull_clock: int | None) -> None:
        h = self._hierarchy
        assert h is not None
        rows, stopping = self._rows, self._stopping is not None
        grads = self._accumulated
        if push_step is not None:  # level 1: the host's gradients, rows and stop flags into the leader
            flat = torch.cat([*self._accumulated, torch.tensor([float(rows), float(stopping)])])
            h.reduce_to_leader(flat)
            grads = list(flat[: sum(self._sizes)].split(self._sizes))
            rows, stopping = int(flat[-2].item()), flat[-1].item() > 0
            self._pushed()
            if not h.is_leader:
                self.stats.bytes_sent += flat.numel() * 4
                self.stats.sync_rounds += 1
        # level 2, on the leader: the host's sum to the server, the weights back; then to the host
        weights = torch.empty(sum(self._sizes)) if pull_clock is not None else None
        meta = torch.zeros(3, dtype=torch.float64)  # min version, clocks ahead, stop
        if h.is_leader:
            assert self._client is not None
            try:
                if stopping:
                    self._client.abort(f"a worker of host {h.host} stopped")
                    raise PeerStopped(f"a worker of host {h.host} (ranks {h.groups[h.host]}) stopped")
                empty_async = pull_clock is None and not rows and self._mode is PsMode.ASYNC
                results = None if empty_async else self._to_server(push_step, pull_clock, rows, grads)
            except SparkDLError as exc:  # the host stops with it
                meta[2] = 1.0
                h.broadcast_from_leader(meta)
                raise agreed(self._stopping or exc) from exc
            if results is not None:
                torch.cat([w for _, w in results], out=weights)
                meta[0] = min(v for v, _ in results)
                meta[1] = self._client.ahead
        h.broadcast_from_leader(meta)
        if meta[2] > 0:
            raise agreed(self._stopping or PeerStopped(f"a worker of host {h.host}'s peers stopped"))
        if weights is None:
            return
        h.broadcast_from_leader(weights)
        if h.is_leader:
            self.stats.bytes_sent += weights.numel() * 4 * h.members
        version = int(meta[0].item())
        self._install([(version, w) for w in weights.split(self._sizes)], int(meta[1].item()))

    def _pushed(self) -> None:
        for acc in self._accumulated:
            acc.zero_()
        self._rows = 0
        if self._factors is not None:
            self._factors.pushed()

    def _install(self, results: list[tuple[int, torch.Tensor]], ahead: int) -> None:
        """Copy pulled shards into the model; note how far ahead the server is."""
        self._skip = ahead
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


def refuse_for_independent_tasks(config: SparkDLConfig) -> None:
    """What ``ps_barrier = false`` (each worker an ordinary task that fails and is retried
    alone) cannot run with, each refused with the reason and the fix.

    Raises:
        ConfigError: the first setting that needs the workers to meet or a global checkpoint.
    """
    settings, training, reliability = config.parameter_server, config.training, config.reliability
    fix = "; or set parameter_server.ps_barrier = true"
    if settings.ps_mode is PsMode.SYNC:
        raise ConfigError(
            "parameter_server.ps_barrier = false with ps_mode = 'sync': a sync step waits for every "
            "worker's push, so one task down stops them all; use ps_mode = 'async', or 'ssp' (its "
            "staleness bound counts only the tasks alive)" + fix
        )
    refusals = [
        (config.runtime.hierarchy.value != "none", f"runtime.hierarchy = {config.runtime.hierarchy.value!r}",
         "a host's workers sum into their leader every push", "set hierarchy = 'none'"),
        (settings.ps_shards > 1, f"ps_shards = {settings.ps_shards}",
         "a task that dies between its pushes to two shards would leave them disagreeing on the rows "
         "its retry must skip", "set ps_shards = 1 (or 0: one shard)"),
        (reliability.min_workers > 0, f"reliability.min_workers = {reliability.min_workers}",
         "each task is retried alone by Spark (spark.task.maxFailures); no stage restarts smaller",
         "set min_workers = 0"),
        (bool(training.validation_fraction or training.validation_col),
         "validation rows (validation_fraction / validation_col)",
         "each worker would validate its own copy of the weights at its own epoch end",
         "validate the returned model with transform"),
        (training.early_stopping_patience > 0,
         f"early_stopping_patience = {training.early_stopping_patience}",
         "no epoch end is shared by the workers", "set early_stopping_patience = 0"),
    ]  # fmt: skip
    for refused, what, why, how in refusals:
        if refused:
            raise ConfigError(f"parameter_server.ps_barrier = false with {what}: {why}; {how}" + fix)
