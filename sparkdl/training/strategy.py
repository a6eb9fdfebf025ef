"""The protocol every sync strategy follows.

A strategy is built complete by its constructor from a :class:`StrategyContext`, and
owns how a step is taken (:meth:`SyncStrategy.train_step`: forward on its model,
backward, what happens after it, whether and how the optimizer steps). What it needs
from the rest of the worker it declares as typed properties (``checkpoint_multiple``);
what the driver, the advisor and a user's own loop need of it, as class variables
(``pattern``, ``serves_own_loop``, ``hosted_on_driver``, ...) and class methods
(``check_settings``, ``check_model``, ``build_module``). A user's own loop reaches it
through the face :meth:`SyncStrategy.own_loop` gives (:mod:`sparkdl.training.own_loop`).
No loop asks which strategy runs; the registry that picks one by name is
:mod:`sparkdl.strategies.registry`.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from sparkdl.comm.exchange import Exchange, FlatExchange
from sparkdl.comm.ps_endpoint import PsEndpoint
from sparkdl.comm.traffic import Pattern
from sparkdl.config import SparkDLConfig, Strategy
from sparkdl.data.tensors import Batch
from sparkdl.errors import ConfigError, SparkDLError
from sparkdl.training.factory import cpu_state_dict
from sparkdl.training.guards import NanGuard
from sparkdl.training.own_loop import OwnLoopFace, RunningStep
from sparkdl.training.precision import Precision
from sparkdl.training.schedules import CONSTANT_LR, LrPlan, ScheduledLr
from sparkdl.training.steps import StepInput, StepOutcome, SyncStats, Verdict

__all__ = [  # the step's data lives in training/steps.py; the protocol speaks it
    "CollectiveForward",
    "SchedulerFn",
    "StepInput",
    "StepOutcome",
    "StrategyContext",
    "SyncStats",
    "SyncStrategy",
    "Verdict",
    "parameter_bytes",
]

#: ``(optimizer) -> torch.optim.lr_scheduler.LRScheduler``, stepped after every optimizer step.
SchedulerFn = Callable[[torch.optim.Optimizer], Any]


@dataclass(frozen=True)
class StrategyContext:
    """Everything a strategy is built from, on one worker.

    Attributes:
        config: the run's settings.
        rank, world_size: this worker and the world.
        device: where the model lives.
        module: the bare model, already on ``device``.
        optimizer: the worker's optimizer over ``module``'s parameters.
        control_group: the gloo group for small CPU messages (None: the default group).
        ps: the parameter server's endpoint (strategy "parameter_server" only).
        attempt: the stage attempt, the same on every rank.
        resume_step: the global step the run resumed from (0: a fresh start).
        lr: the learning-rate schedule, a factor of the configured lr per global step.
        scheduler_fn: the user's ``(optimizer) -> LRScheduler``, stepped after every step.
        store: the process group's key-value store (rank 0's TCPStore), reachable by every
            rank: weight averaging's backup workers count finished periods in it.
        exchange: the door of every sum and broadcast with the other workers, chosen when
            the worker was assembled (default: a single worker's, which sends nothing).
        precision: autocast and the fp16 scaler, shared with the loop (default: built from
            ``training.precision`` for ``device``).
        resumed_state: the entries the strategy put into the checkpoint the run resumed
            from (:meth:`SyncStrategy.checkpoint_state`; empty on a fresh start).
    """

    config: SparkDLConfig
    rank: int
    world_size: int
    device: torch.device
    module: nn.Module
    optimizer: torch.optim.Optimizer
    control_group: dist.ProcessGroup | None = None
    ps: PsEndpoint | None = None
    attempt: int = 0
    resume_step: int = 0
    lr: LrPlan = CONSTANT_LR
    scheduler_fn: SchedulerFn | None = None
    store: dist.Store | None = None
    exchange: Exchange = field(default_factory=lambda: FlatExchange(world_size=1))
    precision: Precision = field(default_factory=Precision)
    resumed_state: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        setting = self.config.training.precision
        if self.precision.setting is not setting:  # the default: build the configured one
            object.__setattr__(self, "precision", Precision(setting, self.device))
        if self.exchange.world_size != self.world_size:
            raise ValueError(
                f"the exchange serves {self.exchange.world_size} workers, the context {self.world_size}: "
                "pass the exchange the worker formed (sparkdl.comm.forming.form_exchange)"
            )


class CollectiveForward:
    """An ability a strategy declares by inheriting it: its model's forward and backward are
    themselves collectives (sharded parameters gathered in them), so every rank must run
    every forward at the same point, in validation and in the label probe too."""


class SyncStrategy(abc.ABC):
    """Keeps the workers' models consistent. One instance per worker per fit.

    Args:
        ctx: what the strategy is built from.
    """

    name: ClassVar[Strategy]
    #: Whether every rank steps on the same averaged gradient, so a non-finite value on
    #: one rank is seen by all at the same step with no further message.
    shares_gradients: ClassVar[bool] = False
    #: How the strategy's exchange uses the network, for the advisor's cost model to price
    #: (None: the cost model has no formula for it, and the advisor only measures it).
    pattern: ClassVar[Pattern | None] = None
    #: Whether what the workers exchange is a plain sum of float tensors, which one host's
    #: shared memory can carry (the worker's assembly then chooses it, where it can).
    plain_sum: ClassVar[bool] = False
    #: Whether the strategy can send fully connected layers' gradients as sufficient factors
    #: (``runtime.sufficient_factors``).
    takes_sufficient_factors: ClassVar[bool] = False
    #: Whether :meth:`prepare_module` replaces the module's parameters with new ones (their
    #: shards): an optimizer built before over the old ones must be pointed at the new.
    shards_parameters: ClassVar[bool] = False
    #: Whether each rank writes its own shards of a checkpoint (:meth:`sharded_state`),
    #: instead of the whole state gathered to rank 0 (:meth:`full_state_dict`).
    writes_shards: ClassVar[bool] = False
    #: Whether a fit may go on with fewer workers from its checkpoint (``min_workers``).
    resizes: ClassVar[bool] = True
    #: Whether the driver hosts the model and runs its optimizer (a server that fit, the own
    #: loop and the advisor start from ``model_fn`` before the stage).
    hosted_on_driver: ClassVar[bool] = False
    #: Whether :meth:`build_module` takes the user's own split (``parallelize_fn``).
    takes_parallelize_fn: ClassVar[bool] = False
    #: Whether :meth:`build_module` compiles the model with ``training.compile``.
    compiles: ClassVar[bool] = True
    #: Whether a user's own loop (``sparkdl.run``) can run under the strategy: its
    #: :meth:`own_loop` then gives each prepared model's face.
    serves_own_loop: ClassVar[bool] = False
    #: Whether every step is a collective of every rank: in a user's own loop a worker whose
    #: rows ran out still takes each step, on a filler batch whose rows count zero. Otherwise
    #: it sits the rest of the epoch out, still joining the syncs (:meth:`OwnLoopFace.step_done`).
    steps_together: ClassVar[bool] = True
    #: How many optimizers one model may have in a user's own loop (None: any number).
    optimizers_per_model: ClassVar[int | None] = 1

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        reliability = ctx.config.reliability
        self.guard = NanGuard(
            reliability.on_nan_loss, reliability.max_nan_skips, ctx.rank, self.shares_gradients
        )
        self.stats = SyncStats()
        self._precision = ctx.precision
        self._lr = None if ctx.lr.is_constant else ScheduledLr(ctx.optimizer, ctx.lr)
        self._scheduler = ctx.scheduler_fn(ctx.optimizer) if ctx.scheduler_fn is not None else None
        self._clip_norm = ctx.config.optimizer.grad_clip_norm

    @classmethod  # noqa: B027 (an optional hook: no rules by default)
    def check_settings(cls, config: SparkDLConfig) -> None:
        """Refuse, with the fix, settings this strategy cannot run with (on the driver,
        before any worker starts; :func:`check_settings` calls it). By default: none.

        Raises:
            ConfigError: naming the settings that clash and what to set instead.
        """

    @classmethod  # noqa: B027 (an optional hook: every model by default)
    def check_model(cls, module: nn.Module, config: SparkDLConfig) -> None:
        """Refuse, with the fix, a model this strategy cannot train (on the driver, on the
        model that preflight and the advisor build; a pipeline needs an ``nn.Sequential``).
        By default: any model.

        Raises:
            ConfigError: naming what the model lacks and what to do instead.
        """

    @classmethod  # noqa: B027 (an optional hook: no rules by default)
    def check_own_loop_settings(cls, config: SparkDLConfig) -> None:
        """Refuse, with the fix, settings this strategy cannot serve a user's own loop with
        (beyond :meth:`check_settings`). By default: none.

        Raises:
            ConfigError: naming the setting and what to set instead.
        """

    @classmethod  # noqa: B027 (an optional hook: every model by default)
    def check_own_loop_model(cls, module: nn.Module, ps: PsEndpoint | None) -> None:
        """Refuse, before the strategy is built over it, a model a user's own loop prepares
        that this strategy cannot keep (the server's model must be ``model_fn``'s). By
        default: any model.

        Raises:
            ConfigError: naming what is wrong with the model.
        """

    @classmethod  # noqa: B027 (an optional hook: the model as it is by default)
    def prepare_own_module(
        cls, module: nn.Module, optimizer: torch.optim.Optimizer, config: SparkDLConfig, device: torch.device
    ) -> None:
        """Make a user's model (on ``device``) and its optimizer, built before, ready for
        the strategy, in place, before it is built over them: a sharding strategy shards the
        model and points the optimizer at the shards. By default: nothing.

        Raises:
            ConfigError: the model or optimizer cannot be prepared so.
        """

    def own_loop(self, optimizer: torch.optim.Optimizer, step: RunningStep) -> OwnLoopFace:
        """This strategy's model and ``optimizer`` in a user's own loop: the face the loop's
        context reaches them through (:mod:`sparkdl.training.own_loop`); ``step`` is the
        running step, kept current by ``ctx.batches``.

        Raises:
            ConfigError: the strategy does not serve a user's own loop.
        """
        raise ConfigError(
            f"strategy = {self.name.value!r} cannot serve your own training loop; train with TorchEstimator"
        )

    @classmethod
    def build_module(
        cls,
        model_fn: Callable[[], nn.Module],
        config: SparkDLConfig,
        device: torch.device,
        parallelize_fn: Callable[[nn.Module, Any], object] | None = None,
    ) -> nn.Module:
        """Build this worker's model with ``model_fn``, on ``device``, ready for the
        optimizer (every rank, once the process group exists). By default the whole model
        on every rank, then :meth:`prepare_module`; a sharding strategy may build it so
        that no rank but one ever holds it whole. ``parallelize_fn``: the user's own split,
        which only tensor parallelism takes; the others build without it (the estimator
        refuses it under them, and the advisor's other candidates leave it out)."""
        from sparkdl.training.factory import build_model, checkpoint_layers

        module = build_model(model_fn).to(device)
        if config.training.activation_checkpointing:
            checkpoint_layers(module)
        module = cls.prepare_module(module, config, device)
        if config.training.compile:
            from sparkdl.training.factory import compile_module

            compile_module(module, config.training.compile_backend)
        return module

    @classmethod
    def prepare_module(cls, module: nn.Module, config: SparkDLConfig, device: torch.device) -> nn.Module:
        """Make the freshly built ``module`` (already on ``device``) ready for this strategy,
        before the optimizer is built over its parameters: a sharding strategy shards it
        here, so that the optimizer holds only this rank's shards. Called on every rank,
        once the process group exists. By default: ``module`` as it is."""
        return module

    @classmethod
    def load_full_state(
        cls,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, torch.Tensor],
        optimizer_state: dict[str, Any],
    ) -> None:
        """Load a full (unsharded) checkpoint, held by every rank, into ``module`` and
        ``optimizer`` (as built by :meth:`prepare_module`). ``optimizer_state`` has the
        format of ``torch.optim.Optimizer.state_dict()``."""
        module.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)

    @classmethod
    def load_shards(
        cls,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        location: Path | str,
        options: dict[str, str],
    ) -> None:
        """Where :attr:`writes_shards`: every rank reads its own parts of the checkpoint
        shards in ``location`` (written by any number of ranks)."""
        raise NotImplementedError(f"{cls.__name__} reads whole checkpoints (load_full_state)")

    @property
    def model(self) -> nn.Module:
        """The module forward and backward run on (may wrap ``ctx.module``)."""
        return self.ctx.module

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state as CPU tensors on rank 0, ``{}`` on the other ranks.

        Every rank calls it at the same point: where parameters are sharded it is a
        collective (the shards are gathered to rank 0). What checkpoints, early stopping
        and the final weights carry."""
        return cpu_state_dict(self.ctx.module) if self.ctx.rank == 0 else {}

    def sharded_state(self) -> dict[str, Any]:
        """Where :attr:`writes_shards`: this rank's parts of the model and optimizer state,
        keyed by parameter name (``torch.distributed.checkpoint``'s layout), for every rank
        to write its own."""
        raise NotImplementedError(f"{type(self).__name__} checkpoints the whole state (full_state_dict)")

    def full_optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's whole state on rank 0 (in the format of
        ``torch.optim.Optimizer.state_dict()``), ``{}`` elsewhere; same contract as
        :meth:`full_state_dict`."""
        return self.ctx.optimizer.state_dict() if self.ctx.rank == 0 else {}

    def load_whole_model(self, state: dict[str, torch.Tensor]) -> None:
        """Set the model to ``state``, the whole model's, held by every rank (a collective
        where parameters are spread: each rank keeps its part)."""
        self.ctx.module.load_state_dict(state)

    def load_whole_optimizer(self, state: dict[str, Any]) -> None:
        """Set the optimizer to ``state`` (as ``optimizer.state_dict()`` numbers it), held by
        every rank; same contract as :meth:`load_whole_model`."""
        self.ctx.optimizer.load_state_dict(state)

    def load_state_from_rank0(self, state: dict[str, torch.Tensor]) -> None:
        """Set the model to ``state``, the full state held by rank 0 (``{}`` on the other
        ranks); every rank calls it. By default only rank 0's copy changes: it is the one
        whose weights are returned. A sharded strategy spreads it to every rank's shards."""
        if state:
            self.ctx.module.load_state_dict(state)

    @property
    def random_stream(self) -> int:
        """Which random stream this worker's steps draw from, when checkpoints reseed it per
        step (``ReseedHook``: seed, stream, step): its rank by default; workers that compute
        on the same rows with the same layers (a tensor-parallel group) share one."""
        return self.ctx.rank

    @property
    def checkpoint_multiple(self) -> int:
        """Checkpoints fall only on global steps that are multiples of this."""
        return 1

    @abc.abstractmethod
    def train_step(self, step: StepInput) -> StepOutcome:
        """Take one step; return what it did (this worker's mean loss on its rows, ...)."""

    def checkpoint_state(self, global_step: int) -> dict[str, Any]:
        """Rank 0 is about to write the checkpoint of ``global_step``: save what the
        strategy holds outside the worker, and return entries for the checkpoint (a
        resumed run hands them back as ``ctx.resumed_state``)."""
        return {}

    def rebase(self, resumed_state: Mapping[str, Any]) -> None:  # noqa: B027 - only weight averaging keeps a reference
        """Every rank's model was just set to the same loaded weights (a user's own loop
        loading a checkpoint after ``ctx.prepare``): start from them, with the strategy's own
        entries of that checkpoint (:meth:`checkpoint_state`)."""

    def finish(self) -> None:  # noqa: B027 - only local-step strategies have work left
        """Training is over: leave every worker with the same final weights."""

    def end_epoch(self) -> SyncStats:
        """Return this epoch's figures, with what the exchange sent, and start counting afresh."""
        traffic = self.ctx.exchange.take_traffic()
        stats, self.stats = self.stats, SyncStats()
        stats.bytes_sent += traffic.bytes_sent
        stats.bytes_across_hosts += traffic.bytes_across_hosts
        return stats

    def close(self) -> None:  # noqa: B027 - only strategies holding resources release them
        """Release what the constructor acquired (called once, by the worker's exit stack)."""

    # ----------------------------------------------------------- shared step pieces

    def _backward(
        self, step: StepInput, batches: tuple[Batch, ...], scale: float, fillers: int = 0
    ) -> torch.Tensor:
        """Forward, loss and backward of ``scale * loss`` over the micro-batches (each
        weighted by its rows, so k micro-batches give the gradient of one batch of their
        union), then over ``fillers`` zero-weight filler batches (for strategies whose
        forward and backward are collectives, so every rank runs as many); return the
        unscaled mean loss of ``batches``. Only the last backward starts DDP's all-reduce."""
        total = sum(len(b) for b in batches)
        runs = [(b, len(b) / total) for b in batches] + [(step.filler(), 0.0)] * fillers
        no_sync = getattr(self.model, "no_sync", None)
        losses = []
        for i, (batch, share) in enumerate(runs):
            last = i == len(runs) - 1
            with contextlib.nullcontext() if no_sync is None or last else no_sync():
                loss = step.loss_of(self.model, batch)
                factor = scale * share
                scaled = loss if factor == 1.0 else loss * factor  # one kernel fewer per step
                try:
                    self._precision.backward(scaled)
                except RuntimeError:
                    failure = self.ctx.exchange.take_hook_failure()  # the hook's own error, typed
                    if failure is None:
                        raise
                    raise failure from None
            if share:
                losses.append((loss.detach().float(), share))
        if len(losses) == 1 and losses[0][1] == 1.0:
            return losses[0][0]  # the common step: one batch
        loss_sum = torch.zeros((), device=self.ctx.device)
        for loss, share in losses:
            loss_sum.add_(loss, alpha=share)
        return loss_sum

    def _optimizer_step(self, step: StepInput) -> None:
        """The worker's optimizer step: the step's learning rate, clipping, the step, the
        user's scheduler. Gradients are already unscaled (fp16) by :meth:`_judge`."""
        optimizer = self.ctx.optimizer
        if self._lr is not None:
            self._lr.apply(step.step)
        if self._clip_norm:
            self._clip_gradients()
        self._precision.step(optimizer)
        if self._scheduler is not None:
            self._scheduler.step()

    def _clip_gradients(self) -> None:
        """Scale the gradients down to ``grad_clip_norm`` where their norm is above it (a
        strategy holding a slice of the model takes the norm over every slice)."""
        torch.nn.utils.clip_grad_norm_(self.ctx.module.parameters(), self._clip_norm)

    def _step_on_shared_gradients(self, step: StepInput, loss: torch.Tensor) -> StepOutcome:
        """The end of a step whose gradients every rank shares: the optimizer step if the
        judges allow it, the gradients cleared either way; the step's outcome (its loss 0
        when skipped: nothing of it reached the weights)."""
        verdict = self._judge(step, loss)
        if verdict is Verdict.APPLY:
            self._optimizer_step(step)
        else:
            loss = torch.zeros((), device=self.ctx.device)
        self.ctx.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(loss, nan_skipped=verdict is Verdict.NAN_SKIPPED)

    def _judge(self, step: StepInput, loss: torch.Tensor) -> Verdict:
        """Whether this step may reach the weights: the precision first (an fp16 overflow of
        the scaled gradients, with a finite loss, is the scaler's to handle), then the NaN
        guard; a failure the guard holds for this rank goes to :meth:`_stop`. The gradients
        are cleared either way by the caller."""
        if self._precision.overflowed(self.ctx.optimizer, loss, self.ctx.module):
            return Verdict.OVERFLOW
        skipped_before = self.guard.skipped
        if self.guard.allows_step(loss, self.model, step.epoch, step.step):
            return Verdict.APPLY
        if self.guard.failure is not None:
            self._stop(self.guard.failure)
        return Verdict.NAN_SKIPPED if self.guard.skipped > skipped_before else Verdict.HELD

    def _stop(self, error: SparkDLError) -> None:
        """This rank must stop with ``error``: by default at once, on this rank alone."""
        raise error


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of all trainable parameters (what one gradient all-reduce moves)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
