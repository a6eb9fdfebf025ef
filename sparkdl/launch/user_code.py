"""The user's own code on the workers, from the driver's side: what ``sparkdl.run`` and the
TorchDistributor share (the function pickled and checked before any Spark job, the
workers' output shown where nothing else shows it)."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

from sparkdl.errors import ConfigError


def pickled_call(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], by: str
) -> tuple[str, bytes]:
    """``function``'s name, and ``(function, args, kwargs)`` cloudpickled for the workers.

    Raises:
        ConfigError: it cannot be pickled: named, with the reason and the usual fix.
    """
    import cloudpickle

    name = getattr(function, "__qualname__", repr(function))
    try:
        return name, cloudpickle.dumps((function, tuple(args), dict(kwargs)))
    except Exception as exc:
        raise ConfigError(
            f"{by} cannot send {name} to the workers: pickling it (with its arguments) failed with "
            f"{type(exc).__name__}: {exc}. Create what it uses (sessions, locks, open files, models on a "
            "GPU) inside the function, or pass it as a plain value"
        ) from exc


@contextlib.contextmanager
def showing_worker_output() -> Iterator[None]:
    """The processes' output on the driver's stdout for the run, where nothing else shows
    ``sparkdl.worker``'s INFO records (no logging configured: a notebook, a plain script)."""
    worker_log = logging.getLogger("sparkdl.worker")
    if logging.getLogger().handlers or worker_log.handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = worker_log.level
    worker_log.addHandler(handler)
    worker_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        worker_log.removeHandler(handler)
        worker_log.setLevel(level)
