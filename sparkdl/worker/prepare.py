"""``ctx.prepare(...)``: a user's own models and optimizers made ready for the run's strategy.

The user's loop keeps calling ``loss.backward()`` and ``optimizer.step()`` as in plain
PyTorch; the strategy chosen by one setting keeps the workers in sync through the same
classes the Estimator's loop uses (:mod:`sparkdl.strategies`), each model with its own
exchange (:func:`~sparkdl.comm.forming.form_exchange`: compression, hierarchy and shared
memory as the settings say). What a strategy does in a user's loop is its own: its class
says whether it serves one (``serves_own_loop``) and what it refuses, and its face
(:meth:`~sparkdl.training.strategy.SyncStrategy.own_loop`) weights the gradients by the
step's rows, acts when a step is over, stands in for the optimizer where the optimizer
runs elsewhere, and reads and loads the whole states. This module names no strategy; each
strategy module's docstring says what its models do here.

A model given without an optimizer (a frozen teacher, an EMA copy) starts from rank 0's
weights on every worker and is otherwise left alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from sparkdl.comm.ps_endpoint import PsEndpoint
from sparkdl.config import SparkDLConfig, SufficientFactors
from sparkdl.errors import ConfigError
from sparkdl.strategies import SyncStrategy, own_loop_strategies, strategy_class
from sparkdl.training.own_loop import OwnLoopFace, RunningStep
from sparkdl.worker.builder import Builder


def check_own_loop_settings(config: SparkDLConfig) -> None:
    """Refuse, before any task starts, what a user's own loop cannot run with.

    Raises:
        ConfigError: naming the setting and what to use instead.
    """
    strategy = config.training.strategy
    kind = strategy_class(strategy)
    if not kind.serves_own_loop:
        names = ", ".join(repr(s.value) for s in own_loop_strategies())
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
    kind.check_own_loop_settings(config)


class Preparer:
    """Prepares the models and optimizers of one worker's run, once each.

    Args:
        build: builds each model's exchange and strategy (and closes them), as every
            worker's assembly does.
        step: the running step's rows, kept current by the feed.
        ps: the parameter server's endpoint, where the driver hosts the model.
    """

    def __init__(self, build: Builder, step: RunningStep, ps: PsEndpoint | None = None) -> None:
        self._build, self._where, self._kind = build, build.where, build.kind
        self._step = step
        self._ps = ps
        self._seen: set[int] = set()
        self._kept: dict[int, OwnLoopFace | None] = {}  # prepared objects, given and returned
        self._strategies: list[SyncStrategy] = []
        self._faces: list[OwnLoopFace] = []  # one per strategy, in the same order
        self._resumed: list[dict[str, Any]] = []  # each strategy's entries of the loaded checkpoint
        self._rebase_due = False  # a checkpoint was loaded: the weights change before the next epoch

    @property
    def needs_fillers(self) -> bool:
        """Whether a worker whose rows ran out must still step, on a filler batch (every step
        is a collective of the strategy's), or sits the rest of the epoch out."""
        return self._kind.steps_together

    def face_of(self, thing: object) -> OwnLoopFace | None:
        """The face of the strategy that keeps ``thing`` (a model or optimizer given to or
        returned by :meth:`prepare`) in sync; None for a model prepared without an optimizer.

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
        it (0: none): each prepared model's face acts (a weight-averaged model counts it toward
        its next average; the server's model pushes and pulls), every rank, every step."""
        for face in self._faces:
            face.step_done(step, rows)

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
        it), each optimizer as it was (or what stands in for it where it runs elsewhere).

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
            if not module_optimizers:
                _from_rank0(module, self._where.world_size)
                ready[id(module)] = module
                self._kept[id(module)] = None
                continue
            strategy, face = self._ready(module, module_optimizers)
            ready[id(module)] = strategy.model
            first = module_optimizers[0]
            if face.optimizer is not first:  # a stand-in: the optimizer runs elsewhere
                ready[id(first)] = face.optimizer
            for thing in (module, strategy.model, *module_optimizers, face.optimizer):
                self._kept[id(thing)] = face
        return tuple(ready.get(id(o), o) for o in objects)

    def finish(self, steps: int) -> None:
        """The run is over after ``steps`` steps of ``ctx.batches``: leave every worker with
        the same weights (a last average; the server's final weights, pulled once every
        worker's last push is in)."""
        self.epoch_begins()  # weights loaded since the last epoch are the strategies' start
        for strategy in self._strategies:
            strategy.finish()
        for face in self._faces:
            face.settle(steps)

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
    ) -> tuple[SyncStrategy, OwnLoopFace]:
        """The strategy over ``module`` and its first optimizer, and its face."""
        kind, where = self._kind, self._where
        allowed = kind.optimizers_per_model
        if allowed is not None and len(optimizers) > allowed:
            raise ConfigError(
                f"ctx.prepare got {len(optimizers)} optimizers over one {type(module).__name__}; "
                f"{kind.name.value} keeps one optimizer's state with the model: give the model one optimizer"
            )
        if kind.hosted_on_driver and self._strategies:
            raise ConfigError(
                f"ctx.prepare got a second model with an optimizer ({type(module).__name__}); the driver "
                f"hosts one model under {kind.name.value} (model_fn's): prepare the others without an "
                "optimizer, or use allreduce or weight_averaging for several"
            )
        kind.check_own_loop_model(module, self._ps)
        kind.prepare_own_module(module, optimizers[0], self._build.config, where.device)
        training = self._build.config.training
        if training.compile:  # in place, as fit's models: same names and state dict
            from sparkdl.training.factory import compile_module

            compile_module(module, training.compile_backend)
        index = len(self._strategies)
        strategy = self._build.strategy(
            module,
            optimizers[0],
            self._build.exchange(module),
            ps=self._ps,
            resumed_state=self._resumed[index] if index < len(self._resumed) else {},
        )
        self._strategies.append(strategy)
        face = strategy.own_loop(optimizers[0], self._step)
        self._faces.append(face)
        return strategy, face


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
