"""The user's functions on their way to the executors: pickled (cloudpickle) on the driver,
and checked there before any Spark job, so that one that cannot travel fails at once with
its name and the reason, not as PySpark's raw ``PicklingError`` from inside a job."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sparkdl.errors import ConfigError

_FIX = (
    "Create what it uses (sessions, locks, open files, models on a GPU) inside the function, "
    "or pass it as a plain value"
)


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
            f"{type(exc).__name__}: {exc}. {_FIX}"
        ) from exc


def check_shippable(functions: Mapping[str, object], by: str) -> None:
    """Every one of ``functions`` (by the argument's name; None and names of built-ins
    skipped) can be pickled for the executors.

    Raises:
        ConfigError: naming the argument, the function and the reason, with the usual fix.
    """
    import cloudpickle

    for argument, function in functions.items():
        if function is None or isinstance(function, str):
            continue
        try:
            cloudpickle.dumps(function)
        except Exception as exc:
            name = getattr(function, "__qualname__", type(function).__name__)
            raise ConfigError(
                f"{by} cannot send {argument} ({name}) to the workers: pickling it failed with "
                f"{type(exc).__name__}: {exc}. {_FIX}"
            ) from exc
