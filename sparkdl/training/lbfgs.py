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
from typing import Any, Protocol

_CURVATURE_MIN = 1e-10  # a history pair is kept only where y.s exceeds this (PyTorch's)
_C1, _C2 = 1e-4, 0.9  # sufficient decrease and curvature constants of the strong Wolfe search


class Vectors(Protocol):
    """The vectors L-BFGS combines, by name, wherever they are held.

    ``"x"`` is the model's parameters as a point, ``"d"`` the search direction; every other
    name is created by :meth:`copy` or :meth:`evaluate` and released by :meth:`delete`.
    """

    def evaluate(self, t: float, out: str) -> float:
        """The objective at ``x + t * d`` (``t = 0``: at x; ``"d"`` need not exist then); its
        gradient there becomes vector ``out``. One distributed pass over every row."""
        ...

    def move(self, t: float) -> None:
        """``x <- x + t * d``: the step the line search chose (the model follows)."""
        ...

    def dot(self, a: str, b: str) -> float: ...

    def axpy(self, alpha: float, x: str, y: str) -> None:
        """``y <- y + alpha * x``."""
        ...

    def scale(self, v: str, alpha: float) -> None: ...

    def copy(self, src: str, dst: str) -> None:
        """``dst <- src``, ``dst`` created if new."""
        ...

    def rename(self, src: str, dst: str) -> None:
        """``dst`` becomes ``src``'s numbers (no copy); ``src`` is gone."""
        ...

    def delete(self, v: str) -> None: ...

    def abs_max(self, v: str) -> float: ...

    def abs_sum(self, v: str) -> float: ...


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
    """

    def __init__(self, vectors: Vectors, settings: LbfgsSettings, state: LbfgsState | None = None) -> None:
        self._v = vectors
        self._settings = settings
        self.state = state or LbfgsState()

    def run(self, on_iteration: Callable[[Iteration], None] = lambda _: None) -> Stop:
        """Iterate until a stopping test holds; ``on_iteration`` sees each finished one
        (where a caller reports progress and checkpoints :attr:`state`)."""
        s, v, settings = self.state, self._v, self._settings
        if s.stopped:
            return Stop(s.stopped)
        if s.iteration == 0 and s.evaluations == 0:
            s.loss = v.evaluate(0.0, "g")
            s.evaluations = 1
            if v.abs_max("g") <= settings.tolerance_grad:
                return self._stop(Stop.GRADIENT)
        while True:
            stop, record = self._iterate()
            if record is not None:
                on_iteration(record)
            if stop is not None:
                return self._stop(stop)

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
            s.loss, t, used = self._strong_wolfe(t, s.loss, gtd, budget - s.evaluations)
            v.move(t)
        else:
            v.move(t)
            used = 0
            if s.iteration != settings.max_iterations:  # PyTorch leaves the last point unevaluated
                s.loss = v.evaluate(0.0, "g")
                used = 1
        s.t = t
        s.evaluations += used
        grad_max = v.abs_max("g")
        record = Iteration(s.iteration, s.loss, grad_max, t, used, s.evaluations)
        if s.iteration == settings.max_iterations:
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

    def _strong_wolfe(self, t: float, f: float, gtd: float, max_ls: int) -> tuple[float, float, int]:
        """A step along ``d`` meeting the strong Wolfe conditions (or the best found within
        ``max_ls`` evaluations): its loss and length, and the evaluations spent. Its gradient
        becomes ``"g"``. Nocedal & Wright's algorithms 3.5 and 3.6, as PyTorch runs them."""
        v = self._v
        d_norm = v.abs_max("d")
        trials = _Trials(v)
        f_new, g_new = trials.evaluate(t)
        evals = 1
        gtd_new = v.dot(g_new, "d")
        t_prev, f_prev, g_prev, gtd_prev = 0.0, f, "g", gtd
        done = False
        ls_iter = 0
        bracket: list[float] = []
        b_f: list[float] = []
        b_g: list[str] = []
        b_gtd: list[float] = []
        while ls_iter < max_ls:
            if f_new > f + _C1 * t * gtd or (ls_iter > 1 and f_new >= f_prev):
                bracket, b_f, b_g, b_gtd = [t_prev, t], [f_prev, f_new], [g_prev, g_new], [gtd_prev, gtd_new]
                break
            if abs(gtd_new) <= -_C2 * gtd:
                bracket, b_f, b_g, b_gtd = [t], [f_new], [g_new], [gtd_new]
                done = True
                break
            if gtd_new >= 0:
                bracket, b_f, b_g, b_gtd = [t_prev, t], [f_prev, f_new], [g_prev, g_new], [gtd_prev, gtd_new]
                break
            # extrapolate: between 1.01 and 10 times the step
            low, high = t + 0.01 * (t - t_prev), t * 10
            previous = t
            t = cubic_minimum(t_prev, f_prev, gtd_prev, t, f_new, gtd_new, (low, high))
            t_prev, f_prev, g_prev, gtd_prev = previous, f_new, g_new, gtd_new
            f_new, g_new = trials.evaluate(t)
            evals += 1
            gtd_new = v.dot(g_new, "d")
            ls_iter += 1
        if ls_iter == max_ls:
            bracket, b_f, b_g, b_gtd = [0.0, t], [f, f_new], ["g", g_new], [gtd, gtd_new]
        insufficient = False
        low_pos, high_pos = (0, 1) if b_f[0] <= b_f[-1] else (1, 0)
        while not done and ls_iter < max_ls:
            if abs(bracket[1] - bracket[0]) * d_norm < self._settings.tolerance_change:
                break
            t = cubic_minimum(bracket[0], b_f[0], b_gtd[0], bracket[1], b_f[1], b_gtd[1])
            # keep away from the bracket's ends: a tenth of its width, once progress stalls
            edge = 0.1 * (max(bracket) - min(bracket))
            if min(max(bracket) - t, t - min(bracket)) < edge:
                if insufficient or t >= max(bracket) or t <= min(bracket):
                    near_high = abs(t - max(bracket)) < abs(t - min(bracket))
                    t = max(bracket) - edge if near_high else min(bracket) + edge
                    insufficient = False
                else:
                    insufficient = True
            else:
                insufficient = False
            f_new, g_new = trials.evaluate(t)
            evals += 1
            gtd_new = v.dot(g_new, "d")
            ls_iter += 1
            if f_new > f + _C1 * t * gtd or f_new >= b_f[low_pos]:
                bracket[high_pos], b_f[high_pos], b_g[high_pos], b_gtd[high_pos] = t, f_new, g_new, gtd_new
                low_pos, high_pos = (0, 1) if b_f[0] <= b_f[1] else (1, 0)
            else:
                if abs(gtd_new) <= -_C2 * gtd:
                    done = True
                elif gtd_new * (bracket[high_pos] - bracket[low_pos]) >= 0:
                    bracket[high_pos], b_f[high_pos] = bracket[low_pos], b_f[low_pos]
                    b_g[high_pos], b_gtd[high_pos] = b_g[low_pos], b_gtd[low_pos]
                bracket[low_pos], b_f[low_pos], b_g[low_pos], b_gtd[low_pos] = t, f_new, g_new, gtd_new
        trials.keep(b_g[low_pos])
        return b_f[low_pos], bracket[low_pos], evals


class _Trials:
    """The line search's trial gradients, each a vector of its own until one is kept as "g"."""

    def __init__(self, vectors: Vectors) -> None:
        self._v = vectors
        self._names: list[str] = []

    def evaluate(self, t: float) -> tuple[float, str]:
        name = f"trial{len(self._names)}"
        self._names.append(name)
        return self._v.evaluate(t, name), name

    def keep(self, chosen: str) -> None:
        """``chosen`` becomes "g" (it may be "g" already); every other trial is released."""
        if chosen != "g":
            self._v.rename(chosen, "g")
        for name in self._names:
            if name != chosen:
                self._v.delete(name)


def cubic_minimum(
    x1: float,
    f1: float,
    g1: float,
    x2: float,
    f2: float,
    g2: float,
    bounds: tuple[float, float] | None = None,
) -> float:
    """The minimum of the cubic through two points with their slopes, kept within ``bounds``
    (default: between the points); their middle where the cubic has no minimum."""
    low, high = bounds if bounds is not None else (min(x1, x2), max(x1, x2))
    d1 = g1 + g2 - 3 * (f1 - f2) / (x1 - x2)
    square = d1 * d1 - g1 * g2
    if square < 0:
        return (low + high) / 2.0
    d2 = math.sqrt(square)
    if x1 <= x2:
        point = x2 - (x2 - x1) * _ratio(g2 + d2 - d1, g2 - g1 + 2 * d2)
    else:
        point = x1 - (x1 - x2) * _ratio(g1 + d2 - d1, g1 - g2 + 2 * d2)
    if math.isnan(point):
        return (low + high) / 2.0
    return min(max(point, low), high)


def _ratio(a: float, b: float) -> float:
    """``a / b`` as IEEE floats divide (a zero ``b`` gives an infinity, which the bounds then
    clip; PyTorch's tensors do the same)."""
    if b == 0:
        return math.copysign(math.inf, a) * math.copysign(1.0, b) if a else math.nan
    return a / b
