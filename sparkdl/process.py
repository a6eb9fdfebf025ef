"""Process-wide state: everything sparkdl keeps in a Python process beyond one call, in one table.

A Python process outlives a fit. The driver runs fit after fit (a notebook, a tuning
loop), and Spark reuses its Python workers from task to task and from job to job. What
sparkdl keeps in such a process on purpose registers here when its module is imported:
where it lives, what it holds, how long it stays, and how to let it go. :func:`kept`
lists what this process holds; :func:`release` drops it (a test, or a notebook that wants
its memory back). Nothing else in sparkdl holds state from one fit to the next, and
nothing replaces a library's function for the whole process.

Registered today: ``data.pool`` and ``spark.inference`` on the executors,
``spark.environment`` and ``services.weights`` on the driver; docs/architecture.md shows the
whole table, which a unit test keeps equal to the registrations.

Outside this table, by design: PySpark's daemon (``sparkdl.spark.daemon``) imports torch
and freezes the garbage collector's view of it before forking workers, for the daemon's
life; a worker seeds torch's random generators with ``training.seed``, as any PyTorch
training script does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Kept:
    """One piece of process-wide state.

    Attributes:
        name: where it lives, as a module path under ``sparkdl`` (``"data.pool"``).
        side: ``"driver"`` or ``"executor"`` (an executor's Python worker).
        holds: what it holds, and why it is worth keeping.
        lasts: how long it stays without :func:`release`.
        release: lets it go (safe to call at any time, from any thread).
    """

    name: str
    side: str
    holds: str
    lasts: str
    release: Callable[[], None]


_KEPT: dict[str, Kept] = {}
_LOCK = threading.Lock()


def keep(name: str, side: str, holds: str, lasts: str, release: Callable[[], None]) -> None:
    """Register a module's process-wide state (called once, when the module is imported)."""
    with _LOCK:
        _KEPT[name] = Kept(name, side, holds, lasts, release)


def kept() -> tuple[Kept, ...]:
    """What this process holds beyond one call, by name (only modules imported so far hold any)."""
    with _LOCK:
        return tuple(_KEPT[name] for name in sorted(_KEPT))


def release(name: str | None = None) -> None:
    """Let go of ``name``'s state, or of everything this process keeps.

    Raises:
        KeyError: ``name`` is not registered; the message lists what is.
    """
    with _LOCK:
        if name is not None and name not in _KEPT:
            raise KeyError(f"no process-wide state named {name!r}; registered: {sorted(_KEPT)}")
        chosen = [_KEPT[name]] if name is not None else list(_KEPT.values())
    for piece in chosen:
        piece.release()
