"""The protocol every sync strategy follows, and the registry that picks one.

A strategy sees the training loop at four points: ``setup`` (wrap the module),
``after_backward`` (gradients are ready), ``after_step`` (the optimizer stepped),
and ``end_epoch`` (report what it sent). The loop never knows which one runs.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from sparkdl.config import SparkDLConfig, Strategy
from sparkdl.errors import ConfigError, SparkDLError


@dataclass(frozen=True)
class WorkerContext:
    """Where one worker runs: its rank, the world and its device."""

    rank: int
    world_size: int
    device: torch.device


@dataclass
class SyncStats:
    """What a strategy did in one epoch."""

    sync_rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    pushes: int = 0
    pulls: int = 0
    staleness_mean: float = 0.0
    staleness_max: int = 0
    wait_s: float = 0.0


class SyncStrategy(abc.ABC):
    """Keeps the workers' models consistent. One instance per worker per fit."""

    name: ClassVar[Strategy]
    #: Whether a worker without rows must still run forward/backward (on a zero-weight
    #: filler batch) because the step contains a collective every worker must join.
    steps_without_data: ClassVar[bool] = True
    #: Whether the strategy applies updates itself (the parameter server's optimizer
    #: runs on the driver), so the worker's optimizer must not step.
    applies_updates: ClassVar[bool] = False
    #: Whether every rank steps on the same (averaged) gradients, so a non-finite value
    #: on one rank is seen by all without another message.
    shares_gradients: ClassVar[bool] = False

    def __init__(self, config: SparkDLConfig) -> None:
        self.config = config
        self.stats = SyncStats()

    @abc.abstractmethod
    def setup(self, module: nn.Module, ctx: WorkerContext) -> nn.Module:
        """Return the module the loop runs forward/backward on (may wrap ``module``)."""

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: B027 - optional hook
        """The optimizer has been built over the module's parameters."""

    @abc.abstractmethod
    def loss_scale(self, local_rows: int, global_rows: int) -> float:
        """Factor on this worker's mean loss before backward."""

    def after_backward(self, step: int) -> None:  # noqa: B027 - optional hook
        """Gradients of this step are ready (and, for all-reduce, already averaged)."""

    def after_step(self, step: int, local_rows: int) -> None:  # noqa: B027 - optional hook
        """Step ``step`` is over; this worker trained on ``local_rows`` rows in it."""

    def stop(self, error: SparkDLError) -> None:
        """This rank must stop training with ``error``; raise it on every rank together at
        the strategy's next sync point (the default: at once, on this rank alone)."""
        raise error

    def checkpoint_state(self, global_step: int) -> dict[str, Any]:
        """Rank 0 is about to write the checkpoint of ``global_step``: save what the
        strategy holds outside the worker, and return entries for the checkpoint."""
        return {}

    def finish(self) -> None:  # noqa: B027 - optional hook
        """Training is over: leave every worker with the same final weights."""

    def end_epoch(self) -> SyncStats:
        """Return this epoch's figures and start counting afresh."""
        stats, self.stats = self.stats, SyncStats()
        return stats

    def teardown(self) -> None:  # noqa: B027 - optional hook
        """Release what ``setup`` acquired."""


_REGISTRY: dict[Strategy, type[SyncStrategy]] = {}


def register(cls: type[SyncStrategy]) -> type[SyncStrategy]:
    """Class decorator adding a strategy to the registry under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def create_strategy(config: SparkDLConfig, **resources: Any) -> SyncStrategy:
    """Build the strategy named by ``config.training.strategy``.

    ``resources`` are handed to strategies that need more than the config (the
    parameter server's endpoint and the stage attempt).
    """
    name = config.training.strategy
    try:
        cls = _REGISTRY[name]
    except KeyError:
        valid = ", ".join(s.value for s in _REGISTRY)
        raise ConfigError(f"strategy {name.value!r} is not available; choose one of {valid}") from None
    return cls(config, **resources) if resources else cls(config)


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of all trainable parameters (what one gradient all-reduce moves)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def ring_allreduce_bytes(payload: int, world_size: int) -> int:
    """Bytes one worker sends in a ring all-reduce of ``payload`` bytes."""
    return 0 if world_size <= 1 else 2 * (world_size - 1) * payload // world_size
