"""``ctx.prepare(...)``: a user's own models and optimizers made ready for the run's strategy.

The user's loop keeps calling ``loss.backward()`` and ``optimizer.step()`` as in plain
PyTorch; the strategy chosen by one setting keeps the workers in sync through the same
classes the Estimator's loop uses (:mod:`sparkdl.strategies`), each model with its own
exchange (:func:`~sparkdl.comm.exchange.form_exchange`: compression, hierarchy and shared
memory as the settings say):

- ``allreduce``: the model comes back wrapped in DDP (its gradient hook the exchange's).
  Each parameter's gradient is scaled by ``world * rows / global_rows`` of the running
  step before DDP averages it, so uneven partitions give exactly the mean over every row
  of the step, as single-process SGD on the union would, and a worker whose rows ran out
  (stepping on a filler batch, ``rows = 0``) adds nothing.
- ``parameter_server``: the server on the driver hosts ``model_fn``'s model and runs the
  optimizer (``optimizer_fn``'s, or the ``[optimizer]`` settings'); the prepared model starts
  from its weights, and the optimizer comes back as a :class:`ServerStep`, whose ``step()``
  adds the gradients, weighted by the step's rows, to the next push. Every step of
  ``ctx.batches`` pushes and pulls (sync and ssp), or as ``push_every``/``pull_every`` say
  (async): exactly all-reduce SGD over every row of the step in sync mode. When the loop
  returns, every worker's last push goes in and each pulls the server's final weights
  (ssp and async: the last pull of the loop may be stale).
- ``fsdp``: every rank starts from rank 0's weights, then the model is sharded in place
  with FSDP2 (the units :func:`~sparkdl.strategies.fsdp.shard_units` picks, then the root),
  and the optimizer given with it is pointed at the shards (it must not have stepped yet),
  so each rank keeps 1/N of the parameters, gradients and optimizer state. Each rank's
  gradient is scaled by the step's share inside the reduce-scatter (FSDP's own hook for a
  custom reduce-scatter), so uneven partitions are exact as under all-reduce.
  :meth:`~sparkdl.worker.context.TrainContext.state_dict` gathers the whole model to rank 0.
- ``weight_averaging``: the model comes back as it is; after every ``sync_every`` steps of
  ``ctx.batches`` the workers' weights, buffers and optimizer state are averaged, each
  weighted by the rows its optimizer trained since the last average (an optimizer step
  post-hook says which steps it took). A worker whose rows ran out takes no step: its
  weight in the next average is the rows it did train.

A model given without an optimizer (a frozen teacher, an EMA copy) starts from rank 0's
weights on every worker and is otherwise left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from sparkdl.comm.forming import Where, form_exchange
from sparkdl.comm.hierarchy import HostGroups
from sparkdl.comm.ps_endpoint import PsEndpoint
from sparkdl.comm.rendezvous import ProcessGroups
from sparkdl.config import LrSchedule, SparkDLConfig, Strategy, SufficientFactors
from sparkdl.errors import ConfigError
from sparkdl.strategies import StrategyContext, SyncStrategy, create_strategy, strategy_class
from sparkdl.strategies.parameter_server import ParameterServerStrategy
from sparkdl.strategies.weight_averaging import WeightAveragingStrategy
from sparkdl.worker.assembly import payload_bytes
from sparkdl.worker.teardown import close_strategy

#: The strategies a user's own loop can run with today.
OWN_LOOP_STRATEGIES = (
    Strategy.ALLREDUCE,
    Strategy.FSDP,
    Strategy.WEIGHT_AVERAGING,
    Strategy.PARAMETER_SERVER,
)


@dataclass
class StepRows:
    """What the feed says of the running step, read by the strategies' hooks.

    Attributes:
        rows: this worker's rows in the step (1 per step where there is no feed).
        scale: ``world * rows / global_rows``: this worker's share of the step's gradient.
        inside: a step of ``ctx.batches`` is running (its batch was yielded, the next not asked for).
    """

    rows: int = 1
    scale: float = 1.0
    inside: bool = False  # a step of ctx.batches is running


def check_own_loop_settings(config: SparkDLConfig) -> None:
    """Refuse, before any task starts, what a user's own loop cannot run with.

    Raises:
        ConfigError: naming the setting and what to use instead.
    """
    strategy = config.training.strategy
    if strategy not in OWN_LOOP_STRATEGIES:
        names = ", ".join(repr(s.value) for s in OWN_LOOP_STRATEGIES)
        raise ConfigError(
            f"strategy = {strategy.value!r} cannot serve your own training loop yet; use {names} "
            f"with sparkdl.run, or train with TorchEstimator, which runs {strategy.value!r}"
        )
    if config.weight_averaging.wa_backup_workers or config.parameter_server.backup_workers:
        raise ConfigError(
            "backup workers cannot serve your own training loop (a worker cannot skip steps the "
            "loop takes itself); set wa_backup_workers = 0 and backup_workers = 0"
        )
    if 0 < config.reliability.min_workers < config.training.num_workers:
        raise ConfigError(
            f"min_workers = {config.reliability.min_workers} cannot serve your own training loop yet (it "
            "would rerun train_fn on fewer workers, which your loop may not expect); set min_workers = 0, "
            "or train with TorchEstimator"
        )
    if config.runtime.sufficient_factors is not SufficientFactors.OFF:
        raise ConfigError(
            f"sufficient_factors = {config.runtime.sufficient_factors.value!r} cannot serve your own "
            "training loop yet (the factors are summed by sparkdl's step, after its backward); set "
            "sufficient_factors = 'off', or train with TorchEstimator"
        )
    if config.training.precision.value == "fp16":
        raise ConfigError(
            "precision = 'fp16' needs a gradient scaler in the optimizer step, which your own loop "
            "takes itself: use precision = 'bf16' with ctx.autocast() (no scaler needed), or "
            "torch.autocast and torch.amp.GradScaler in your loop with precision = 'fp32'"
        )
    if config.optimizer.optimizer.value == "lbfgs":
        raise ConfigError(
            "optimizer = 'lbfgs' is TorchEstimator's full-batch training and cannot serve your own "
            "loop; build torch.optim.LBFGS over ctx.prepare's model yourself, or train with TorchEstimator"
        )
    if strategy is Strategy.PARAMETER_SERVER:
        _check_served_settings(config)


def _check_served_settings(config: SparkDLConfig) -> None:
    """What the parameter server cannot do in a user's own loop yet."""
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


class Preparer:
    """Prepares the models and optimizers of one worker's run, once each.

    Args:
        config: the run's settings.
        where: this worker's place (rank, world, peers, device).
        groups: the process groups the workers formed.
        hierarchy: the two levels of ``runtime.hierarchy`` (None: flat).
        step: the running step's rows, kept current by the feed.
        stack: owns what is formed here (exchanges, strategies).
    """

    def __init__(
        self,
        config: SparkDLConfig,
        where: Where,
        groups: ProcessGroups,
        hierarchy: HostGroups | None,
        step: StepRows,
        stack: contextlib.ExitStack,
        ps: PsEndpoint | None = None,
    ) -> None:
        self._config, self._where, self._groups, self._hierarchy = config, where, groups, hierarchy
        self._step = step
        self._stack = stack
        self._ps = ps
        self._seen: set[int] = set()
        self._kept: dict[int, SyncStrategy | None] = {}  # prepared objects, given and returned
        self._strategies: list[SyncStrategy] = []
        self._steppers: list[_Period | ServerStep] = []  # what each step of ctx.batches moves on
        self._served = False  # the server's model is prepared (it hosts one)
        self._resumed: list[dict[str, Any]] = []  # each strategy's entries of the loaded checkpoint
        self._rebase_due = False  # a checkpoint was loaded: the weights change before the next epoch

    @property
    def needs_fillers(self) -> bool:
        """Whether a worker whose rows ran out must still step (on a filler batch): under
        all-reduce and fsdp every step is a collective; weight averaging's steps are local."""
        return self._config.training.strategy in (Strategy.ALLREDUCE, Strategy.FSDP)

    def strategy_of(self, thing: object) -> SyncStrategy | None:
        """The strategy that keeps ``thing`` (a model or optimizer given to or returned by
        :meth:`prepare`) in sync; None for a model prepared without an optimizer.

        Raises:
            ConfigError: ``thing`` was never prepared.
        """
        if id(thing) not in self._kept:
            raise ConfigError(
                f"a {type(thing).__name__} that ctx.prepare never saw: pass the model or optimizer "
                "given to ctx.prepare, or the one it returned"
            )
        return self._kept[id(thing)]

    def step_done(self, step: int, rows: int) -> None:
        """Step ``step`` of ``ctx.batches`` is over on this worker, which had ``rows`` rows in
        it (0: none): every weight-averaged model counts it toward its next average, and the
        server's model pushes what its optimizer's steps added and pulls (every rank, every
        step, whether its optimizer stepped or not)."""
        for stepper in self._steppers:
            stepper.step_done(step, rows)

    def checkpoint_entries(self, step: int) -> list[dict[str, Any]]:
        """Each prepared strategy's own entries for the checkpoint of ``step`` (rank 0), in the
        order the models were prepared: weight averaging's outer momentum."""
        return [strategy.checkpoint_state(step) for strategy in self._strategies]

    def resume(self, entries: list[dict[str, Any]]) -> None:
        """A checkpoint with ``entries`` was loaded: a strategy prepared from now on starts
        from its entries, and every prepared one takes the loaded weights as its starting
        point when the next epoch begins (:meth:`epoch_begins`; the loop loads them into its
        models in between)."""
        self._resumed, self._rebase_due = list(entries), True

    def weights_loaded(self) -> None:
        """The loop loaded weights into a prepared model (``ctx.load_state_dict``): every
        strategy takes the weights as its starting point when the next epoch begins."""
        self._rebase_due = True

    def epoch_begins(self) -> None:
        """``ctx.batches`` starts an epoch (every rank): after a checkpoint was loaded, each
        strategy rebases on the weights the loop loaded."""
        if self._rebase_due:
            for index, strategy in enumerate(self._strategies):  # one prepared before the save has none
                strategy.rebase(self._resumed[index] if index < len(self._resumed) else {})
            self._rebase_due = False

    def prepare(self, *objects: nn.Module | torch.optim.Optimizer) -> tuple[object, ...]:
        """``objects`` (models and optimizers, in any order) ready for the strategy, returned in
        the same order: each model on the worker's device (wrapped where the strategy wraps
        it), each optimizer as it was.

        Raises:
            ConfigError: something that is neither; a model or optimizer prepared before; an
                optimizer over none of the models given.
        """
        modules = [o for o in objects if isinstance(o, nn.Module)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        self._check(objects, modules, optimizers)
        owners = _owners(modules, optimizers)
        ready: dict[int, object] = {}
        for module in modules:
            module.to(self._where.device)
            module_optimizers = owners.get(id(module), [])
            ready[id(module)], stand_in = self._ready(module, module_optimizers)
            if stand_in is not None:
                ready[id(module_optimizers[0])] = stand_in
            strategy = self._strategies[-1] if module_optimizers else None
            for thing in (module, ready[id(module)], *module_optimizers, stand_in):
                if thing is not None:
                    self._kept[id(thing)] = strategy
        return tuple(ready.get(id(o), o) for o in objects)

    def finish(self, steps: int) -> None:
        """The run is over after ``steps`` steps of ``ctx.batches``: leave every worker with
        the same weights (a last average; the server's final weights, pulled once every
        worker's last push is in)."""
        self.epoch_begins()  # weights loaded since the last epoch are the strategies' start
        for strategy in self._strategies:
            strategy.finish()
        served = [s for s in self._strategies if isinstance(s, ParameterServerStrategy)]
        if served and self._where.world_size > 1:
            torch.distributed.barrier(group=self._groups.control)
        for strategy in served:
            strategy.settle(steps)

    def _check(
        self,
        objects: Iterable[object],
        modules: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
    ) -> None:
        for thing in objects:
            if not isinstance(thing, (nn.Module, torch.optim.Optimizer)):
                raise ConfigError(
                    f"ctx.prepare takes models (torch.nn.Module) and optimizers (torch.optim.Optimizer); "
                    f"got a {type(thing).__name__}"
                )
            if id(thing) in self._seen:
                raise ConfigError(
                    f"ctx.prepare was called twice on the same {type(thing).__name__}; prepare each model "
                    "and optimizer once, and use what it returned"
                )
        self._seen.update(id(thing) for thing in objects)

    def _ready(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> tuple[nn.Module, ServerStep | None]:
        """The model under the strategy, and the stand-in for its optimizer (the parameter
        server's), if any."""
        where = self._where
        if not optimizers:
            _from_rank0(module, where.world_size)
            return module, None
        if len(optimizers) > 1 and self._config.training.strategy is not Strategy.ALLREDUCE:
            raise ConfigError(
                f"ctx.prepare got {len(optimizers)} optimizers over one {type(module).__name__}; "
                f"{self._config.training.strategy.value} keeps one optimizer's state with the model: "
                "give the model one optimizer"
            )
        if self._ps is not None:
            self._check_served(module)
        kind = strategy_class(self._config.training.strategy)
        if kind.shards_parameters:
            _shard_for(module, optimizers[0], self._config, where)
        exchange = form_exchange(
            self._config.runtime,
            where,
            self._groups,
            payload_bytes(module),
            kind.plain_sum,
            self._hierarchy,
        )
        self._stack.callback(exchange.close)
        context = StrategyContext(
            config=self._config,
            rank=where.rank,
            world_size=where.world_size,
            device=where.device,
            module=module,
            optimizer=optimizers[0],
            control_group=self._groups.control,
            ps=self._ps,
            attempt=self._groups.attempt,
            store=self._groups.store,
            exchange=exchange,
            resumed_state=self._resumed[len(self._strategies)]
            if len(self._strategies) < len(self._resumed)
            else {},
        )
        strategy = create_strategy(context)
        self._stack.callback(close_strategy, strategy)
        self._strategies.append(strategy)
        if isinstance(strategy, WeightAveragingStrategy):
            self._steppers.append(_Period(strategy, optimizers[0]))
        elif isinstance(strategy, ParameterServerStrategy):
            stand_in = ServerStep(optimizers[0], strategy, self._step)
            self._steppers.append(stand_in)
            self._served = True
            return strategy.model, stand_in
        elif kind.shards_parameters:
            _scale_reduce_scatter(module, self._step)
        elif where.world_size > 1:
            _scale_gradients(module, self._step)
        return strategy.model, None

    def _check_served(self, module: nn.Module) -> None:
        """The server hosts one model, built on the driver by ``model_fn``: this one must have
        its parameters (in number and in size), and no other model with an optimizer may come.

        Raises:
            ConfigError: a second model with an optimizer; a model unlike the server's.
        """
        assert self._ps is not None
        if self._served:
            raise ConfigError(
                f"ctx.prepare got a second model with an optimizer ({type(module).__name__}); the parameter "
                "server hosts one model (model_fn's): prepare the others without an optimizer, or use "
                "allreduce or weight_averaging for several"
            )
        sizes = [p.numel() for p in module.parameters()]
        indices = [i for shard in self._ps.shard_params for i in shard]
        served = sum(self._ps.shard_sizes) if self._ps.shard_sizes else None
        per_shard = [sum(sizes[i] for i in shard if i < len(sizes)) for shard in self._ps.shard_params]
        unlike = bool(self._ps.shard_sizes) and per_shard != list(self._ps.shard_sizes)
        if len(sizes) != len(indices) or unlike:
            raise ConfigError(
                f"ctx.prepare got a {type(module).__name__} of {len(sizes)} parameters "
                f"({sum(sizes)} values); the parameter server hosts model_fn's model of "
                f"{len(indices)} parameters"
                + (f" ({served} values)" if served is not None else "")
                + ": prepare the model model_fn builds"
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

    def __init__(
        self, optimizer: torch.optim.Optimizer, strategy: ParameterServerStrategy, step: StepRows
    ) -> None:
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


def _owners(
    modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]
) -> dict[int, list[torch.optim.Optimizer]]:
    """Each model's optimizers: those holding its parameters.

    Raises:
        ConfigError: an optimizer holds parameters of none of the models, of several, or some
            of no model.
    """
    by_parameter = {id(p): id(m) for m in modules for p in m.parameters()}
    owners: dict[int, list[torch.optim.Optimizer]] = {}
    for optimizer in optimizers:
        owned = [by_parameter.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
        stray = owned.count(None)
        if 0 < stray < len(owned):  # none at all: refused below, as over none of the models
            raise ConfigError(
                f"ctx.prepare got a {type(optimizer).__name__} holding {stray} parameter(s) of no model "
                "given with it (a learnable scale kept outside the model?); the strategy keeps only a "
                "model's parameters in sync: make them nn.Parameter attributes of the model and prepare it"
            )
        held = set(owned) - {None}
        if not held:
            raise ConfigError(
                f"ctx.prepare got a {type(optimizer).__name__} over none of the models given with it; "
                "pass each optimizer together with its model: ctx.prepare(model, optimizer)"
            )
        if len(held) > 1:
            raise ConfigError(
                f"ctx.prepare got a {type(optimizer).__name__} over the parameters of {len(held)} models; "
                "give each model its own optimizer, or wrap the models in one nn.Module"
            )
        owners.setdefault(held.pop(), []).append(optimizer)  # type: ignore[arg-type]
    return owners


def _from_rank0(module: nn.Module, world_size: int) -> None:
    """Every worker starts ``module`` from rank 0's weights (as DDP does)."""
    if world_size > 1:
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                torch.distributed.broadcast(tensor.data, src=0)


def _shard_for(
    module: nn.Module, optimizer: torch.optim.Optimizer, config: SparkDLConfig, where: Where
) -> None:
    """Shard ``module`` in place (every rank from rank 0's weights) and point ``optimizer``,
    built over its whole parameters, at the shards that replaced them (by name).

    Raises:
        ConfigError: the optimizer has stepped already (its state is of the whole parameters).
    """
    if optimizer.state:
        raise ConfigError(
            f"ctx.prepare got a {type(optimizer).__name__} that holds state already (it stepped, or it "
            f"builds its state when constructed, as Adagrad does); with strategy = "
            f"{config.training.strategy.value!r} its state must be built over the shards: prepare the "
            "model and optimizer before the first step (load a checkpoint with ctx.load_state_dict after), "
            "or use an optimizer that builds its state at its first step"
        )
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise ConfigError(
            f"strategy = 'fsdp' in your own loop needs FSDPModule.set_custom_reduce_scatter, which torch "
            f"{torch.__version__} lacks; install a newer torch, or use allreduce"
        )
    names = {id(p): name for name, p in module.named_parameters()}
    strategy_class(config.training.strategy).prepare_module(module, config, where.device)
    shards = dict(module.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [shards[names[id(p)]] for p in group["params"]]
    cast(Any, module).set_requires_gradient_sync = _deferred_sync_refused


def _deferred_sync_refused(*_: object, **__: object) -> None:
    raise ConfigError(
        "set_requires_gradient_sync on a model ctx.prepare sharded: sparkdl weights each step's gradient "
        "by its rows as FSDP reduce-scatters it, so a reduction deferred over several steps would weight "
        "them all by the last one; accumulate by calling backward on each micro-batch (each reduces at once)"
    )


def _scale_reduce_scatter(module: nn.Module, step: StepRows) -> None:
    """Scale each rank's gradient by the step's share as FSDP reduce-scatters it (before the
    sum: the mean FSDP takes is then the mean over every row of the step)."""
    from torch.distributed.fsdp import FSDPModule

    from sparkdl.strategies.fsdp import ScaledReduceScatter

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            # FSDP's ReduceScatter interface, by its two methods (torch exports no name for it)
            unit.set_custom_reduce_scatter(cast(Any, ScaledReduceScatter(lambda: step.scale)))


def _scale_gradients(module: nn.Module, step: StepRows) -> None:
    """Scale each parameter's gradient by the step's share before DDP averages it (a tensor
    hook runs before the gradient is accumulated, so before DDP's hook reads it). A filler's
    gradient becomes zeros, not ``0 * g``, which an infinite value would turn into NaN."""

    def scaled(grad: torch.Tensor) -> torch.Tensor | None:
        if step.scale == 1.0:
            return None
        return torch.zeros_like(grad) if step.scale == 0.0 else grad * step.scale

    for parameter in module.parameters():
        if parameter.requires_grad:
            parameter.register_hook(scaled)


class _Period:
    """A weight-averaged model's count toward its next average: the steps of ``ctx.batches``
    (the same on every rank, whether its optimizer stepped or not: a skipped step, e.g. by
    an fp16 scaler, never puts the ranks out of step), and the rows its optimizer trained."""

    def __init__(self, strategy: WeightAveragingStrategy, optimizer: torch.optim.Optimizer) -> None:
        self._strategy = strategy
        self._stepped = False
        self._pending_rows = 0  # rows since the optimizer's last step (accumulated gradients)
        optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, *_: object) -> None:
        self._stepped = True

    def step_done(self, step: int, rows: int) -> None:
        self._pending_rows += rows
        trained = self._pending_rows if self._stepped else 0
        if self._stepped:
            self._pending_rows, self._stepped = 0, False
        self._strategy.local_step_done(step, trained)
