"""L-BFGS as a coordinator of vector operations: Sandblaster's optimizer (DistBelief).

The algorithm never touches a vector's numbers. It names vectors ("x" the parameters, "g"
the gradient at x, "d" the direction, the history pairs "s<i>"/"y<i>", the line search's
trial gradients) and asks a :class:`Vectors` to combine them: dot products, axpy, scaling.
Where the vectors live is the holder's business: every worker holds them whole (strategy
allreduce: :class:`sparkdl.training.full_batch.ReplicatedVectors`), or each parameter
server shard holds its slice and the driver only ever sees scalars (Sandblaster's layout),
so that neither the model nor the history crosses to one place.

The iterates are PyTorch's (``torch.optim.LBFGS`` with one ``step`` of ``max_iter``
iterations): the same two-loop recursion, curvature rule (a pair is kept when
``y.s > 1e-10``), first step ``min(1, 1/|g|_1) * lr``, strong Wolfe line search with cubic
interpolation (c1 = 1e-4, c2 = 0.9), evaluation budget and stopping tests. Scalars are
Python floats (float64) where PyTorch keeps float32 tensors, so iterates agree to rounding.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparkdl.training.line_search import Vectors, strong_wolfe

__all__ = ["Iteration", "Lbfgs", "LbfgsSettings", "LbfgsState", "Stop", "Vectors"]

_CURVATURE_MIN = 1e-10  # a history pair is kept only where y.s exceeds this (PyTorch's)


@dataclass(frozen=True)
class LbfgsSettings:
    """What ``[lbfgs]`` and ``[optimizer]`` set (PyTorch's names and defaults but two:
    ``history_size`` 10, as Spark's ``LogisticRegression``, and ``max_iterations`` 100).

    Attributes:
        lr: the step the line search starts from (after the first iteration's).
        max_iterations: iterations at most.
        max_evaluations: passes over the data at most (0: ``max_iterations * 5 // 4``).
        tolerance_grad: stop once the gradient's largest magnitude is at most this.
        tolerance_change: stop once the loss or the step changes less than this.
        history_size: correction pairs kept.
        line_search: strong Wolfe (True) or a fixed step of ``lr`` (False).
    """

    lr: float = 1.0
    max_iterations: int = 100
    max_evaluations: int = 0
    tolerance_grad: float = 1e-7
    tolerance_change: float = 1e-9
    history_size: int = 10
    line_search: bool = True

    @property
    def evaluation_budget(self) -> int:
        return self.max_evaluations or self.max_iterations * 5 // 4


class Stop(str, enum.Enum):
    """Why L-BFGS stopped."""

    GRADIENT = "tolerance_grad"  # the gradient is at most tolerance_grad everywhere
    CHANGE = "tolerance_change"  # the loss, the step or the slope changed less than tolerance_change
    ITERATIONS = "max_iterations"
    EVALUATIONS = "max_evaluations"


@dataclass(frozen=True)
class Iteration:
    """One finished iteration, as ``history`` reports it.

    Attributes:
        iteration: 1-based.
        loss: the objective at the new point.
        grad_max: the new gradient's largest magnitude.
        step: the step length taken along the direction.
        evaluations: passes over the data this iteration took (its line search's).
        total_evaluations: passes since the start, the first one (at the start point) included.
    """

    iteration: int
    loss: float
    grad_max: float
    step: float
    evaluations: int
    total_evaluations: int


@dataclass
class LbfgsState:
    """The scalars of a run between iterations; with the vectors ``x``, ``g``, ``d``,
    ``g_prev`` and the history pairs, all there is to resume it exactly.

    ``pairs`` names the history's vectors, oldest first (``(s, y)``), ``rho`` their
    ``1 / y.s``; ``evaluations`` counts passes since the start (the budget's).
    """

    iteration: int = 0
    evaluations: int = 0
    loss: float = math.nan
    prev_loss: float = math.nan
    t: float = 0.0
    h_diag: float = 1.0
    pairs: list[tuple[str, str]] = field(default_factory=list)
    rho: list[float] = field(default_factory=list)
    next_pair: int = 0
    stopped: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "evaluations": self.evaluations,
            "loss": self.loss,
            "prev_loss": self.prev_loss,
            "t": self.t,
            "h_diag": self.h_diag,
            "pairs": [list(p) for p in self.pairs],
            "rho": list(self.rho),
            "next_pair": self.next_pair,
            "stopped": self.stopped,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LbfgsState:
        fields = dict(data)
        fields["pairs"] = [(s, y) for s, y in fields["pairs"]]
        return cls(**fields)


class Lbfgs:
    """Runs L-BFGS on ``vectors`` from the point ``"x"`` (or from ``state``, resumed).

    Args:
        vectors: where the vectors live and how the objective is evaluated.
        settings: the iteration, budget and tolerance settings.
        state: a resumed run's scalars (its vectors already restored in ``vectors``).
        accept: sees the objective at every point the run stands on (the start, each
            iteration's; its gradient is ``"g"``) and may stop the run there (a holder's
            check that it is finite). A trial point of the line search is not one: an
            overflow there only shortens the step, as in PyTorch.
    """

    def __init__(
        self,
        vectors: Vectors,
        settings: LbfgsSettings,
        state: LbfgsState | None = None,
        accept: Callable[[float], None] = lambda _: None,
    ) -> None:
        self._v = vectors
        self._settings = settings
        self._accept = accept
        self.state = state or LbfgsState()

    def run(self, on_iteration: Callable[[Iteration], None] = lambda _: None) -> Stop:
        """Iterate until a stopping test holds; ``on_iteration`` sees each finished one
        (where a caller reports progress and checkpoints :attr:`state`)."""
        s, v, settings = self.state, self._v, self._settings
        if s.stopped:
            return Stop(s.stopped)
        if s.iteration >= settings.max_iterations:  # resumed by a run that allows no more
            return self._stop(Stop.ITERATIONS)
        if s.iteration == 0 and s.evaluations == 0:
            s.loss = v.evaluate(0.0, "g")
            s.evaluations = 1
            self._accept(s.loss)
            if v.abs_max("g") <= settings.tolerance_grad:
                return self._stop(Stop.GRADIENT)
        while True:
            stop, record = self._iterate()
            if stop is not None:  # decided first: a checkpoint taken in on_iteration knows it
                self._stop(stop)
            if record is not None:
                on_iteration(record)
            if stop is not None:
                return stop

    def _stop(self, why: Stop) -> Stop:
        self.state.stopped = why.value
        return why

    def _iterate(self) -> tuple[Stop | None, Iteration | None]:
        """One iteration: a direction, a step along it; what stops the run after it, if anything."""
        s, v, settings = self.state, self._v, self._settings
        s.iteration += 1
        first = s.iteration == 1
        if first:
            v.copy("g", "d")
            v.scale("d", -1.0)
            s.h_diag = 1.0
        else:
            self._remember_curvature()
            self._direction()
        v.copy("g", "g_prev")
        s.prev_loss = s.loss
        t = min(1.0, 1.0 / v.abs_sum("g")) * settings.lr if first else settings.lr
        gtd = v.dot("g", "d")
        if gtd > -settings.tolerance_change:
            return Stop.CHANGE, None  # not a descent direction any more: nothing to gain along it
        budget = settings.evaluation_budget
        if settings.line_search:
            left = budget - s.evaluations
            s.loss, t, used = strong_wolfe(v, t, s.loss, gtd, left, settings.tolerance_change)
            v.move(t)
        else:
            v.move(t)
            used = 0
            if s.iteration != settings.max_iterations:  # PyTorch leaves the last point unevaluated
                s.loss = v.evaluate(0.0, "g")
                used = 1
        s.t = t
        s.evaluations += used
        if used:
            self._accept(s.loss)
        grad_max = v.abs_max("g")
        record = Iteration(s.iteration, s.loss, grad_max, t, used, s.evaluations)
        if s.iteration >= settings.max_iterations:
            return Stop.ITERATIONS, record
        if s.evaluations >= budget:
            return Stop.EVALUATIONS, record
        if grad_max <= settings.tolerance_grad:
            return Stop.GRADIENT, record
        if abs(t) * v.abs_max("d") <= settings.tolerance_change:
            return Stop.CHANGE, record
        if abs(s.loss - s.prev_loss) < settings.tolerance_change:
            return Stop.CHANGE, record
        return None, record

    def _remember_curvature(self) -> None:
        """Add the last step's pair ``s = t d``, ``y = g - g_prev`` where it has curvature."""
        s, v = self.state, self._v
        name = s.next_pair
        s_name, y_name = f"s{name}", f"y{name}"
        v.copy("g", y_name)
        v.axpy(-1.0, "g_prev", y_name)
        v.copy("d", s_name)
        v.scale(s_name, s.t)
        ys = v.dot(y_name, s_name)
        if ys <= _CURVATURE_MIN:
            v.delete(s_name)
            v.delete(y_name)
            return
        if len(s.pairs) == self._settings.history_size:
            oldest_s, oldest_y = s.pairs.pop(0)
            s.rho.pop(0)
            v.delete(oldest_s)
            v.delete(oldest_y)
        s.pairs.append((s_name, y_name))
        s.rho.append(1.0 / ys)
        s.next_pair += 1
        s.h_diag = ys / v.dot(y_name, y_name)

    def _direction(self) -> None:
        """``d = -H g`` by the two-loop recursion over the history."""
        s, v = self.state, self._v
        v.copy("g", "d")
        v.scale("d", -1.0)
        alphas = [0.0] * len(s.pairs)
        for i in range(len(s.pairs) - 1, -1, -1):
            s_i, y_i = s.pairs[i]
            alphas[i] = v.dot(s_i, "d") * s.rho[i]
            v.axpy(-alphas[i], y_i, "d")
        v.scale("d", s.h_diag)
        for i, (s_i, y_i) in enumerate(s.pairs):
            beta = v.dot(y_i, "d") * s.rho[i]
            v.axpy(alphas[i] - beta, s_i, "d")
