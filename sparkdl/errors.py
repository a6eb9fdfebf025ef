"""One error hierarchy for everything sparkdl raises to its users.

Every error here pickles intact (``__reduce__`` rebuilds it from its constructor
arguments), so an error raised inside a Spark task on an executor reaches the
driver with its type and fields, not as a generic string.
"""

from __future__ import annotations

from typing import Any


class SparkDLError(Exception):
    """Base class of every error sparkdl raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.message,))

    def __str__(self) -> str:
        return self.message


class ConfigError(SparkDLError, ValueError):
    """A setting is unknown, of the wrong type, or inconsistent with another one."""


class SchemaError(SparkDLError, ValueError):
    """The input DataFrame does not have the columns or types the estimator needs."""


class BadDataError(SparkDLError, ValueError):
    """Rows of the input hold values that cannot be trained on (nulls, ragged arrays, ...).

    Attributes:
        column: the offending column.
        bad_rows: how many rows of the batch or partition were bad.
    """

    def __init__(self, message: str, column: str = "", bad_rows: int = 0) -> None:
        super().__init__(message)
        self.column = column
        self.bad_rows = bad_rows

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.message, self.column, self.bad_rows))


class PeerStopped(SparkDLError):
    """Another worker rejected its input or stopped training; this worker stopped with it."""


def agreed(error: SparkDLError) -> SparkDLError:
    """Mark ``error`` as raised by every rank at the same point of training: the task then
    ends normally with the error in its result, and Spark does not re-run a stage that
    would fail alike."""
    error.agreed_by_all_ranks = True  # type: ignore[attr-defined]
    return error


class ClusterConfigError(SparkDLError):
    """The Spark cluster cannot run the barrier stage as configured."""


class RendezvousError(SparkDLError):
    """Workers could not find each other or form a process group in time."""


class CollectiveError(SparkDLError):
    """A collective operation (all-reduce, broadcast) failed or timed out."""


class TrainingFailedError(SparkDLError):
    """The training stage failed; ``causes`` maps rank to that rank's error text."""

    def __init__(self, message: str, causes: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.causes = dict(causes or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.message, self.causes))
