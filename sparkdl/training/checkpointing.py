"""What a checkpoint holds, when it is written, and how a worker resumes from it.

A checkpoint holds the whole model and optimizer state, in the format of
``module.state_dict()`` and ``optimizer.state_dict()``, whatever the strategy: the
strategy hands it over (:meth:`SyncStrategy.full_state_dict`) and loads it back
(:meth:`SyncStrategy.load_full_state`); rank 0 writes it. A strategy whose parameters are
sharded over the ranks (:attr:`SyncStrategy.writes_shards`: fsdp, tensor parallelism)
gathers nothing: each rank writes its own shards (:mod:`sparkdl.storage.sharded`), then
rank 0 the checkpoint file naming them, in the background once the shards are copied to host
memory. Any strategy and number of ranks resumes from
either kind. Every rank passes the checkpoint steps: the writes are collectives.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from sparkdl.errors import CheckpointError
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
        self._group: dist.ProcessGroup | None = None

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
        """Every rank: the strategy's full state (a gather), after which rank 0 writes the
        checkpoint; or each rank's shards, copied to host memory and written in the
        background (:meth:`_save_shards`)."""
        if self.strategy.writes_shards:
            self._save_shards(position)
            return
        model = self.strategy.full_state_dict()
        optimizer = self.strategy.full_optimizer_state_dict()
        if self.rank == 0:
            self.store.save(position.global_steps_done, self._state(position, model, optimizer))
            self.written += 1

    def _save_shards(self, position: Position) -> None:
        """Each rank copies its shards to host memory; training goes on while its store's
        thread writes them (DCP, a collective over a group of the writing threads alone) and
        then, on rank 0, the file that makes them visible. The previous checkpoint's writes
        end first, on every rank (one in flight)."""
        step = position.global_steps_done
        self._flush_everywhere()  # before the copy: one copy of the shards in host memory at a time
        if self.rank == 0:
            self.store.retract(step)  # before any rank writes: the shard writes wait for rank 0
        location = self.store.shards_for(step)
        staged = sharded.stage(self.strategy.sharded_state())
        group, options = self._writers_group(), self.store.options
        state = None
        if self.rank == 0:
            name = PurePosixPath(str(location)).name
            state = {**self._state(position, {}, {}), "shards": name}
            self.written += 1
        self.store.save_sharded(step, lambda: sharded.save(staged, location, options, group), state)

    def _flush_everywhere(self) -> None:
        """Every rank waits for its previous write; if any rank's failed (rank 0's file, one
        rank's shards), every rank raises, rather than the others start the next write and
        wait on the failed one in its collectives.

        Raises:
            CheckpointError: this rank's failure, or word of another's.
        """
        failure: CheckpointError | None = None
        try:
            self.store.flush()
        except CheckpointError as exc:
            failure = exc
        if self._group is not None:  # a group of the writers' alone: no write runs now
            failed = torch.tensor([0 if failure is None else 1])
            dist.all_reduce(failed, group=self._group)
            if failure is None and int(failed) > 0:
                failure = CheckpointError(
                    f"the previous checkpoint's write failed on {int(failed)} other rank(s); their error "
                    f"names the cause (checkpoint_dir = {self.store.directory})"
                )
        if failure is not None:
            raise failure

    def _writers_group(self) -> dist.ProcessGroup:
        """The group the shard writes' collectives run in, on the stores' threads: one no
        training collective uses (made on the first sharded checkpoint, by every rank)."""
        if self._group is None:
            timeout = timedelta(seconds=self.store.upload_timeout_s)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        return self._group

    def _state(self, position: Position, model: dict[str, Any], optimizer: dict[str, Any]) -> dict[str, Any]:
        """Rank 0's checkpoint of ``position``: the whole model and optimizer (empty where
        shards hold them), the strategy's own state, where training stands, the history."""
        step = position.global_steps_done
        return {
            "strategy": self.strategy.checkpoint_state(step),
            "format": 1,
            "model": model,
            "optimizer": optimizer,
            "epoch": position.epoch,
            "epoch_steps_done": position.epoch_steps_done,
            "global_steps_done": step,
            "world_size": self.strategy.ctx.world_size,
            "history": json.dumps(self.history),
        }


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
