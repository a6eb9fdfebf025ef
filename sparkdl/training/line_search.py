"""The strong Wolfe line search of L-BFGS (Nocedal & Wright's algorithms 3.5 and 3.6, as
PyTorch's ``torch.optim.lbfgs._strong_wolfe`` runs them), over named vectors: the search
handles scalars (losses, slopes, step lengths) and asks a :class:`Vectors` holder for the
objective along the direction and for dot products, wherever the vectors live.
"""

from __future__ import annotations

import math
from typing import Protocol

C1, C2 = 1e-4, 0.9  # the sufficient decrease and curvature constants


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


def strong_wolfe(
    vectors: Vectors, t: float, f: float, gtd: float, max_ls: int, tolerance_change: float
) -> tuple[float, float, int]:
    """A step along ``"d"`` from the point ``"x"`` (loss ``f``, slope ``gtd``, gradient
    ``"g"``) that meets the strong Wolfe conditions, or the best found within ``max_ls``
    evaluations: its loss and length, and the evaluations spent. Its gradient becomes ``"g"``.
    """
    search = _Search(vectors, f, gtd, tolerance_change)
    done = search.bracket(t, max_ls)
    search.zoom(done, max_ls)
    return search.result()


class _Search:
    """One line search: the bracketing phase, then the zoom inside the bracket."""

    def __init__(self, vectors: Vectors, f: float, gtd: float, tolerance_change: float) -> None:
        self._v = vectors
        self._f, self._gtd = f, gtd
        self._tolerance_change = tolerance_change
        self._d_norm = vectors.abs_max("d")
        self._trials = _Trials(vectors)
        self.evals = 0
        self.ls_iter = 0
        # the bracket: step lengths, losses, gradients (vector names) and slopes at its ends
        self.t: list[float] = []
        self.f: list[float] = []
        self.g: list[str] = []
        self.gtd: list[float] = []
        self.low = 0

    def _evaluate(self, t: float) -> tuple[float, str, float]:
        f_new, g_new = self._trials.evaluate(t)
        self.evals += 1
        return f_new, g_new, self._v.dot(g_new, "d")

    def _set(self, t: list[float], f: list[float], g: list[str], gtd: list[float]) -> None:
        self.t, self.f, self.g, self.gtd = t, f, g, gtd

    def bracket(self, t: float, max_ls: int) -> bool:
        """Grow the step until an interval holds a Wolfe point; True if ``t`` is one itself."""
        f, gtd = self._f, self._gtd
        f_new, g_new, gtd_new = self._evaluate(t)
        t_prev, f_prev, g_prev, gtd_prev = 0.0, f, "g", gtd
        while self.ls_iter < max_ls:
            if f_new > f + C1 * t * gtd or (self.ls_iter > 1 and f_new >= f_prev):
                self._set([t_prev, t], [f_prev, f_new], [g_prev, g_new], [gtd_prev, gtd_new])
                return False
            if abs(gtd_new) <= -C2 * gtd:  # before the slope's sign: a Wolfe point ends the search
                self._set([t], [f_new], [g_new], [gtd_new])
                return True
            if gtd_new >= 0:
                self._set([t_prev, t], [f_prev, f_new], [g_prev, g_new], [gtd_prev, gtd_new])
                return False
            # extrapolate: between 1.01 and 10 times the step
            low, high = t + 0.01 * (t - t_prev), t * 10
            previous = t
            t = cubic_minimum(t_prev, f_prev, gtd_prev, t, f_new, gtd_new, (low, high))
            t_prev, f_prev, g_prev, gtd_prev = previous, f_new, g_new, gtd_new
            f_new, g_new, gtd_new = self._evaluate(t)
            self._trials.prune({g_prev, g_new})  # at most two trial gradients held at a time
            self.ls_iter += 1
        self._set([0.0, t], [f, f_new], ["g", g_new], [gtd, gtd_new])  # out of evaluations
        return False

    def zoom(self, done: bool, max_ls: int) -> None:
        """Shrink the bracket around a Wolfe point, by cubic interpolation kept a tenth of the
        bracket's width from its ends once progress stalls."""
        b_t, b_f, b_g, b_gtd = self.t, self.f, self.g, self.gtd
        f, gtd = self._f, self._gtd
        insufficient = False
        low, high = (0, 1) if b_f[0] <= b_f[-1] else (1, 0)
        while not done and self.ls_iter < max_ls:
            if abs(b_t[1] - b_t[0]) * self._d_norm < self._tolerance_change:
                break
            t = cubic_minimum(b_t[0], b_f[0], b_gtd[0], b_t[1], b_f[1], b_gtd[1])
            edge = 0.1 * (max(b_t) - min(b_t))
            if min(max(b_t) - t, t - min(b_t)) < edge:
                if insufficient or t >= max(b_t) or t <= min(b_t):
                    near_high = abs(t - max(b_t)) < abs(t - min(b_t))
                    t = max(b_t) - edge if near_high else min(b_t) + edge
                    insufficient = False
                else:
                    insufficient = True
            else:
                insufficient = False
            f_new, g_new, gtd_new = self._evaluate(t)
            self.ls_iter += 1
            if f_new > f + C1 * t * gtd or f_new >= b_f[low]:
                b_t[high], b_f[high], b_g[high], b_gtd[high] = t, f_new, g_new, gtd_new
                low, high = (0, 1) if b_f[0] <= b_f[1] else (1, 0)
            else:
                if abs(gtd_new) <= -C2 * gtd:
                    done = True
                elif gtd_new * (b_t[high] - b_t[low]) >= 0:
                    b_t[high], b_f[high], b_g[high], b_gtd[high] = b_t[low], b_f[low], b_g[low], b_gtd[low]
                b_t[low], b_f[low], b_g[low], b_gtd[low] = t, f_new, g_new, gtd_new
            self._trials.prune(set(b_g))  # the bracket's ends: two trial gradients at most
        self.low = low

    def result(self) -> tuple[float, float, int]:
        self._trials.keep(self.g[self.low])
        return self.f[self.low], self.t[self.low], self.evals


class _Trials:
    """The line search's trial gradients, each a vector of its own until one is kept as "g"."""

    def __init__(self, vectors: Vectors) -> None:
        self._v = vectors
        self._names: list[str] = []  # the trials held now
        self._made = 0

    def evaluate(self, t: float) -> tuple[float, str]:
        name = f"trial{self._made}"
        self._made += 1
        self._names.append(name)
        return self._v.evaluate(t, name), name

    def prune(self, live: set[str]) -> None:
        """Release the trials no longer named in the search (the bracket's ends, the last two)."""
        for name in [n for n in self._names if n not in live]:
            self._v.delete(name)
            self._names.remove(name)

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
    if x1 == x2:  # a bracket that collapsed (tolerance_change = 0): nothing to interpolate
        return min(max(x1, low), high)
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
