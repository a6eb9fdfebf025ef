"""What a checkpoint holds, when it is written, and how a worker resumes from it.

A checkpoint holds the whole model and optimizer state, in the format of
``module.state_dict()`` and ``optimizer.state_dict()``, whatever the strategy: the
strategy hands it over (:meth:`SyncStrategy.full_state_dict`) and loads it back
(:meth:`SyncStrategy.load_full_state`); rank 0 writes it. A strategy whose parameters are
sharded over the ranks (:attr:`SyncStrategy.writes_shards`: fsdp, tensor parallelism)
gathers nothing: each rank writes its own shards (:mod:`sparkdl.storage.sharded`), then
rank 0 the checkpoint file naming them. Any strategy and number of ranks resumes from
either kind. Every rank passes the checkpoint steps: the writes are collectives.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sparkdl.storage import sharded
from sparkdl.storage.checkpoint_store import CheckpointStore
from sparkdl.training.optimizer_state import named_to_indexed, parameter_names

if TYPE_CHECKING:
    from sparkdl.training.strategy import SyncStrategy

log = logging.getLogger(__name__)

#: ``(module, optimizer, model state, optimizer state)``: puts a full checkpoint in place.
StateLoader = Callable[[nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor], dict[str, Any]], None]
#: ``(module, optimizer, shards' folder, storage options)``: every rank reads its own parts.
ShardLoader = Callable[[nn.Module, torch.optim.Optimizer, "Path | str", dict[str, str]], None]


@dataclass(frozen=True)
class Position:
    """Where training stands: ``epoch`` (1-based) and steps already done in it and overall."""

    epoch: int = 1
    epoch_steps_done: int = 0
    global_steps_done: int = 0


@dataclass
class Resume:
    """A loaded checkpoint: where to continue, and the figures of the recovery."""

    position: Position
    history: list[dict[str, Any]]
    steps_redone: int
    recovery_started: float  # wall time of the last step finished before the failure
    recovered_at: float = 0.0  # wall time when the restored state was in place
    strategy_state: dict[str, Any] = field(default_factory=dict)  # what checkpoint_state added


class Checkpointer:
    """Writes checkpoints on rank 0; every rank runs it at the same steps (the strategy's
    full state may be a collective gather).

    Args:
        store: the run's checkpoint directory.
        every: checkpoint every this many global steps (0: only at epoch ends).
        rank: this worker's rank; only rank 0 writes.
        module: the unwrapped model.
        optimizer: the worker's optimizer.
        strategy: gives the full model and optimizer state, saves its own state first
            (the parameter server's shards), adds entries to the checkpoint, and says on
            which steps checkpoints may fall (``checkpoint_multiple``: weight averaging
            only right after an average, when all workers agree).
    """

    def __init__(
        self,
        store: CheckpointStore,
        every: int,
        rank: int,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: SyncStrategy,
    ) -> None:
        self.store = store
        self.every = every
        self.rank = rank
        self.module = module
        self.optimizer = optimizer
        self.strategy = strategy
        self.align = strategy.checkpoint_multiple
        self.history: list[dict[str, Any]] = []
        self.written = 0

    def after_step(self, position: Position) -> None:
        if self.rank == 0:
            self.store.record_progress(position.global_steps_done)
        if self.every and position.global_steps_done % self.every == 0:
            self._save(position)

    def after_epoch(self, position: Position) -> None:
        """``position`` is the start of the next epoch."""
        if position.global_steps_done % self.align == 0:
            self._save(position)

    def _save(self, position: Position) -> None:
        """Every rank: the strategy's full state (a gather), or each rank's shards written
        by it; then rank 0 writes the checkpoint."""
        step = position.global_steps_done
        shards: dict[str, str] = {}
        if self.strategy.writes_shards:
            if self.rank == 0:
                self.store.retract(step)  # before any rank writes: the shard writes wait for rank 0
            location = self.store.shards_for(step)
            sharded.save(self.strategy.sharded_state(), location, self.store.options)
            model, optimizer = {}, {}
            shards = {"shards": PurePosixPath(str(location)).name}  # what the file names
        else:
            model = self.strategy.full_state_dict()
            optimizer = self.strategy.full_optimizer_state_dict()
        if self.rank != 0:
            return
        extra = self.strategy.checkpoint_state(step)
        state = {
            **shards,
            "strategy": extra,
            "format": 1,
            "model": model,
            "optimizer": optimizer,
            "epoch": position.epoch,
            "epoch_steps_done": position.epoch_steps_done,
            "global_steps_done": position.global_steps_done,
            "world_size": self.strategy.ctx.world_size,
            "history": json.dumps(self.history),
        }
        self.store.save(step, state)
        self.written += 1


_KERNEL_FLAGS = ("fused", "foreach", "capturable")


def kernel_choice(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's kernel flags, as this run built the optimizer."""
    return [{k: group[k] for k in _KERNEL_FLAGS if k in group} for group in optimizer.param_groups]


def keep_kernel_choice(optimizer: torch.optim.Optimizer, kernels: list[dict[str, Any]]) -> None:
    """Put back the kernel flags a checkpoint's param groups overwrote, and keep each
    ``step`` counter where those kernels expect it (a fused or capturable Adam: a float32
    tensor on the parameter's device; otherwise a CPU one).

    ``load_state_dict`` copies the saved groups' flags: a checkpoint of a fused GPU run
    would make an fsdp run call a fused kernel that has no sharded version, and an unfused
    checkpoint would leave a fused run's fp16 scaler handing the step flags it refuses.
    """
    for group, flags in zip(optimizer.param_groups, kernels, strict=True):
        group.update(flags)
        on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, torch.Tensor):
                target = param.device if on_device else torch.device("cpu")
                optimizer.state[param]["step"] = step.to(device=target, dtype=torch.float32)


def restore(
    store: CheckpointStore,
    global_steps_done: int,
    rank: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    load: StateLoader | None = None,
    world_size: int | None = None,
    load_shards: ShardLoader | None = None,
) -> Resume:
    """Load checkpoint ``global_steps_done`` into the module and optimizer (every rank),
    with ``load`` (the strategy's :meth:`~SyncStrategy.load_full_state`; by default
    ``load_state_dict`` on both). A checkpoint of shards is read by ``load_shards`` (a
    sharded strategy's: each rank reads the parts it holds, resharded), else assembled
    whole here first. A checkpoint written by another number of workers
    (``world_size``: this run's) resumes its epoch from its first step: the data is split
    anew, so the rows its first steps trained are not the new split's first rows (some
    rows of that epoch train twice, none is left out)."""
    started = time.time()
    state = store.load(global_steps_done)
    kernels = kernel_choice(optimizer)
    if "shards" in state and load_shards is not None:
        load_shards(module, optimizer, store.shards_for(global_steps_done), store.options)
    else:
        if "shards" in state:  # a sharded run's, into a strategy without shards: assembled whole
            whole = sharded.load_whole(store.shards_for(global_steps_done), store.options)
            state["model"] = whole["model"]
            state["optimizer"] = named_to_indexed(whole["optimizer"], parameter_names(module, optimizer))
        if load is None:
            module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        else:
            load(module, optimizer, state["model"], state["optimizer"])
    keep_kernel_choice(optimizer, kernels)
    position = Position(int(state["epoch"]), int(state["epoch_steps_done"]), int(state["global_steps_done"]))
    saved_world = state.get("world_size")
    if world_size is not None and saved_world is not None and int(saved_world) != world_size:
        position = Position(position.epoch, 0, position.global_steps_done)
    history = json.loads(state["history"])
    progress = store.progress()
    redone = max(progress.step - position.global_steps_done, 0) if progress else 0
    since = progress.wall_time if progress else started
    log.info("rank %d resumed from step %d (%d steps to redo)", rank, position.global_steps_done, redone)
    return Resume(position, list(history), redone, since, time.time(), dict(state.get("strategy", {})))


def whole_checkpoint(store: CheckpointStore, global_step: int) -> dict[str, Any]:
    """Checkpoint ``global_step`` with its whole model state under ``"model"``, assembled in
    this process where ranks wrote their shards (the optimizer's then keyed by parameter
    name): to inspect a run's checkpoint, or to take its weights elsewhere."""
    state = store.load(global_step)
    if "shards" in state:
        whole = sharded.load_whole(store.shards_for(global_step), store.options)
        state["model"], state["optimizer"] = whole["model"], whole["optimizer"]
    return state
