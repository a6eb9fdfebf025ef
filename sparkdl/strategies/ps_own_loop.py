"""The parameter server in a user's own loop (``sparkdl.run``).

The server on the driver hosts ``model_fn``'s model and runs the optimizer
(``optimizer_fn``'s, or the ``[optimizer]`` settings'); the prepared model starts from its
weights, and the optimizer comes back as a :class:`ServerStep`, whose ``step()`` adds the
gradients, weighted by the step's rows, to the next push. Every step of ``ctx.batches``
pushes and pulls (sync and ssp), or as ``push_every``/``pull_every`` say (async): exactly
all-reduce SGD over every row of the step in sync mode. When the loop returns, every
worker's last push goes in and each pulls the server's final weights (ssp and async: the
last pull of the loop may be stale).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from sparkdl.comm.ps_endpoint import PsEndpoint
from sparkdl.config import LrSchedule, SparkDLConfig
from sparkdl.errors import ConfigError
from sparkdl.training.own_loop import OwnLoopFace, RunningStep, WholeModel


class Pushes(WholeModel, Protocol):
    """The parameter-server strategy, as its own-loop face drives it."""

    def add_gradients(self, rows: int) -> None: ...

    def step_done(self, step: int) -> None: ...

    def settle(self, steps: int) -> None: ...


def check_served_settings(config: SparkDLConfig) -> None:
    """What the parameter server cannot do in a user's own loop yet.

    Raises:
        ConfigError: a learning-rate schedule, or a checkpoint directory.
    """
    optimizer = config.optimizer
    if optimizer.lr_schedule is not LrSchedule.CONSTANT or optimizer.warmup_steps:
        raise ConfigError(
            "lr_schedule and warmup_steps with the parameter server in your own loop: the server runs "
            "the optimizer and does not know your loop's length; leave them at their defaults, or pass "
            "optimizer_fn and schedule inside it"
        )
    if config.reliability.checkpoint_dir:
        raise ConfigError(
            "checkpoint_dir with the parameter server in your own loop: the server's weights are not "
            "in ctx's checkpoints, so a resumed run would not start from them; leave checkpoint_dir "
            "unset, or use allreduce or weight_averaging to resume from ctx's checkpoints"
        )


def check_served_model(module: nn.Module, ps: PsEndpoint | None) -> None:
    """The server hosts one model, built on the driver by ``model_fn``, and serves its trainable
    parameters: a worker's model (fit's, or the one a user's loop prepares) must train the same
    parameters, in number and in size (its frozen ones stay on the worker).

    Raises:
        ConfigError: a model unlike the server's.
    """
    if ps is None:
        raise ConfigError("strategy 'parameter_server' needs a server; sparkdl.run starts one on the driver")
    params = list(module.parameters())
    sizes = [p.numel() for p in params]
    trainable = [i for i, p in enumerate(params) if p.requires_grad]
    indices = sorted(i for shard in ps.shard_params for i in shard)
    served = sum(ps.shard_sizes) if ps.shard_sizes else None
    per_shard = [sum(sizes[i] for i in shard if i < len(sizes)) for shard in ps.shard_params]
    unlike = bool(ps.shard_sizes) and per_shard != list(ps.shard_sizes)
    if indices != trainable or unlike:
        raise ConfigError(
            f"the worker's {type(module).__name__} has {len(sizes)} parameters ({sum(sizes)} values), "
            f"{len(trainable)} of them trainable ({sum(sizes[i] for i in trainable)} values); the "
            f"parameter server serves the {len(indices)} trainable parameters of model_fn's model"
            + (f" ({served} values)" if served is not None else "")
            + ", numbered "
            + str(indices[:8])
            + ("..." if len(indices) > 8 else "")
            + ": use the model model_fn builds, with the same parameters frozen"
        )


class ServedFace(OwnLoopFace):
    """The server's model in a user's own loop: its optimizer is a :class:`ServerStep`,
    every step of ``ctx.batches`` pushes and pulls, and the end pulls the final weights. Its
    state is the server's: neither the model's nor the optimizer's loads here.

    Args:
        strategy: the model's parameter-server strategy.
        optimizer: the user's optimizer over the model (its own state is not used).
        step: the running step's rows.
        rank, world_size: this worker and the world.
        control: the group the workers meet in before the final pull (None: the default group).
    """

    def __init__(
        self,
        strategy: Pushes,
        optimizer: torch.optim.Optimizer,
        step: RunningStep,
        rank: int,
        world_size: int,
        control: dist.ProcessGroup | None,
    ) -> None:
        super().__init__(strategy, optimizer, rank)
        self._strategy, self._world, self._control = strategy, world_size, control
        self._server_step = ServerStep(optimizer, strategy, step)

    @property
    def optimizer(self) -> object:
        return self._server_step

    def step_done(self, step: int, rows: int) -> None:
        self._server_step.step_done(step, rows)

    def settle(self, steps: int) -> None:
        if self._world > 1:  # every worker's last push is in before the final pull
            dist.barrier(group=self._control)
        self._strategy.settle(steps)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        raise ConfigError(
            "ctx.state_dict of the parameter server's optimizer: the server on the driver runs it and "
            "holds its state; save the model's state (ctx.state_dict(model)) instead"
        )

    def load_model_state(self, state: dict[str, Any]) -> None:
        self._refuse_load()

    def load_optimizer_state(self, optimizer: Any, state: dict[str, Any]) -> None:
        self._refuse_load()

    @staticmethod
    def _refuse_load() -> None:
        raise ConfigError(
            "ctx.load_state_dict on the parameter server's model or optimizer: the server on the "
            "driver holds its weights and runs its optimizer, and the next pull would undo the load; "
            "start the server from your weights in model_fn instead"
        )


class ServerStep:
    """What ``ctx.prepare`` returns for the optimizer of the parameter server's model: its
    :meth:`step` adds the gradients, weighted by the rows they came from (every step of
    ``ctx.batches`` since the last call: accumulation works), to the next push and clears
    them; the server runs the optimizer (``model_fn``'s model, ``optimizer_fn``'s optimizer),
    and every step of ``ctx.batches`` pushes and pulls. ``zero_grad`` and ``param_groups``
    are the optimizer's; its ``step`` refuses, so that a loop that kept the original is told.

    Args:
        optimizer: the user's optimizer over the model (its own state is not used).
        strategy: the model's parameter-server strategy.
        step: the running step's rows.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: Pushes, step: RunningStep) -> None:
        self.optimizer = optimizer
        self._strategy = strategy
        self._step = step
        self._pending_rows = 0  # rows of earlier steps whose gradients are still in .grad
        self._stepped = False
        optimizer.register_step_pre_hook(_use_the_prepared_one)

    def step(self, closure: object = None) -> None:
        if closure is not None:
            raise ConfigError(
                "the parameter server's optimizer step takes no closure: the optimizer runs on the "
                "server; call step() after backward"
            )
        if not self._step.inside:
            raise ConfigError(
                "optimizer.step() outside a step of ctx.batches: with the parameter server every step "
                "of ctx.batches pushes what its steps added; step inside the loop over ctx.batches"
            )
        self._strategy.add_gradients(self._pending_rows + self._step.rows)
        self._pending_rows, self._stepped = 0, True

    def step_done(self, step: int, rows: int) -> None:
        """Step ``step`` of ``ctx.batches``, with ``rows`` rows, is over: push and pull (rows
        not yet stepped wait for the next ``step()``)."""
        if not self._stepped:
            self._pending_rows += rows
        self._stepped = False
        self._strategy.step_done(step)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> object:
        return getattr(self.optimizer, name)


def _use_the_prepared_one(*_: object) -> None:
    raise ConfigError(
        "optimizer.step() on the optimizer given to ctx.prepare: with the parameter server the server "
        "runs it; use the optimizer ctx.prepare returned (model, optimizer = ctx.prepare(model, optimizer))"
    )
