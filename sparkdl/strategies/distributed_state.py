"""The state of strategies whose parameters are DTensors spread over the ranks (fsdp's
shards, tensor parallelism's split layers), through PyTorch's
``torch.distributed.checkpoint``: each rank's own parts for checkpoints, written and read
back by the ranks that hold them (:mod:`sparkdl.storage.sharded`, resharded where the
layout changed); the whole state gathered to rank 0 for the final weights and early
stopping, in the format every other strategy writes (``module.state_dict()``, and
``optimizer.state_dict()`` numbering the parameters in order); and spread back from a
whole state (another strategy's checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from sparkdl.storage import sharded
from sparkdl.training.optimizer_state import indexed_to_named, named_to_indexed, parameter_names
from sparkdl.training.strategy import SyncStrategy

GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
FULL = StateDictOptions(full_state_dict=True)


class DistributedState(SyncStrategy):
    """A strategy whose module holds DTensors: its whole state is a collective to read and
    to write (every rank calls these at the same point)."""

    writes_shards = True

    def sharded_state(self) -> dict[str, Any]:
        return own_parts(self.ctx.module, self.ctx.optimizer)

    @classmethod
    def load_shards(
        cls,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        location: Path | str,
        options: dict[str, str],
    ) -> None:
        """Every rank: the parts of the checkpoint shards in ``location`` this rank holds
        (written by any number of ranks), into ``module`` and ``optimizer``."""
        state = own_parts(module, optimizer)
        sharded.load_into(state, location, options)
        set_model_state_dict(module, state["model"])
        set_optimizer_state_dict(module, optimizer, state["optimizer"])

    @classmethod
    def load_full_state(
        cls,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, torch.Tensor],
        optimizer_state: dict[str, Any],
    ) -> None:
        """Every rank holds the full checkpoint; each keeps its own part of it."""
        load_whole_model(module, model_state)
        load_whole_optimizer(module, optimizer, optimizer_state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Gathered to rank 0 (a collective); ``{}`` on the other ranks."""
        state = get_model_state_dict(self.ctx.module, options=GATHER)
        return cast(dict[str, torch.Tensor], state) if self.ctx.rank == 0 else {}

    def full_optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state gathered to rank 0 (a collective), numbered as
        ``optimizer.state_dict()`` numbers it; ``{}`` on the other ranks."""
        module, optimizer = self.ctx.module, self.ctx.optimizer
        by_name = get_optimizer_state_dict(module, optimizer, options=GATHER)
        if self.ctx.rank != 0:
            return {}
        return named_to_indexed(by_name, parameter_names(module, optimizer))

    def load_whole_model(self, state: dict[str, torch.Tensor]) -> None:
        load_whole_model(self.ctx.module, state)

    def load_whole_optimizer(self, state: dict[str, Any]) -> None:
        load_whole_optimizer(self.ctx.module, self.ctx.optimizer, state)

    def load_state_from_rank0(self, state: dict[str, torch.Tensor]) -> None:
        """Rank 0's full state, broadcast and spread into every rank's part (a collective)."""
        set_model_state_dict(self.ctx.module, cast(dict[str, Any], state), options=FROM_RANK0)


def own_parts(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's parts of the model and optimizer state, keyed by parameter name (no
    collective, no copy: the model's entries are its parameters)."""
    return {"model": get_model_state_dict(module), "optimizer": get_optimizer_state_dict(module, optimizer)}


def load_whole_model(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``state``, the whole model's (held by every rank), into each rank's part of ``module``."""
    set_model_state_dict(module, cast(dict[str, Any], state), options=FULL)


def load_whole_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``state``, the whole optimizer's as ``optimizer.state_dict()`` numbers it (held by every
    rank), into each rank's part of ``optimizer`` over ``module``."""
    by_name = indexed_to_named(state, parameter_names(module, optimizer))
    set_optimizer_state_dict(module, optimizer, by_name, options=FULL)
