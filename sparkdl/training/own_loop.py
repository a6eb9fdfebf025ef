"""A strategy's face to a user's own training loop (``sparkdl.run``'s ``ctx.prepare``).

The Estimator's loop hands each step to :meth:`SyncStrategy.train_step`. A user's own loop
takes its steps itself (``loss.backward()``, ``optimizer.step()``), so a strategy that
serves it (:attr:`SyncStrategy.serves_own_loop`) says instead, through an
:class:`OwnLoopFace` per prepared model, what happens around those steps: how gradients
are weighted by the step's rows, what runs when a step of ``ctx.batches`` is over, what
stands in for the user's optimizer, and how the model's and the optimizer's whole states
are read and loaded. ``sparkdl.worker.prepare`` builds the faces and never names a
strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class RunningStep:
    """What the feed says of the running step of ``ctx.batches``, read by the faces' hooks.

    Attributes:
        rows: this worker's rows in the step (1 per step where there is no feed).
        scale: ``world * rows / global_rows``: this worker's share of the step's gradient.
        inside: a step of ``ctx.batches`` is running (its batch was yielded, the next not asked for).
    """

    rows: int = 1
    scale: float = 1.0
    inside: bool = False


class WholeModel(Protocol):
    """What a face reads and loads the model's whole state through (a strategy)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_whole_model(self, state: dict[str, torch.Tensor]) -> None: ...


class OwnLoopFace:
    """One prepared model (with its optimizer) under its strategy, in a user's own loop.

    The default serves a strategy that leaves the model's optimizer to the user and needs
    nothing between steps; a strategy overrides what it does differently.

    Args:
        strategy: the model's strategy, built over the model and ``optimizer``.
        optimizer: the user's optimizer over the model.
        rank: this worker's rank.
    """

    def __init__(self, strategy: WholeModel, optimizer: torch.optim.Optimizer, rank: int) -> None:
        self.whole = strategy
        self.given = optimizer
        self.rank = rank

    @property
    def optimizer(self) -> object:
        """What ``ctx.prepare`` returns for the user's optimizer (by default: itself)."""
        return self.given

    def step_done(self, step: int, rows: int) -> None:
        """Step ``step`` of ``ctx.batches`` is over on this worker, which had ``rows`` rows in
        it (0: none). Every rank calls it for every step, whether its optimizer stepped or not."""

    def settle(self, steps: int) -> None:
        """The run is over after ``steps`` steps, and every strategy has finished
        (:meth:`SyncStrategy.finish`): leave the model with its final weights."""

    def model_state(self) -> dict[str, Any]:
        """The model's whole state on rank 0, ``{}`` elsewhere (every rank calls it)."""
        return self.whole.full_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The whole state of ``optimizer`` (one of the model's, as given to ``ctx.prepare``
        or as it returned it) on rank 0, ``{}`` elsewhere."""
        return dict(optimizer.state_dict()) if self.rank == 0 else {}

    def load_model_state(self, state: dict[str, Any]) -> None:
        """Set the model to ``state``, the whole model's, held by every rank."""
        self.whole.load_whole_model(state)

    def load_optimizer_state(self, optimizer: Any, state: dict[str, Any]) -> None:
        """Set ``optimizer`` (one of the model's) to ``state``, held by every rank."""
        optimizer.load_state_dict(state)
