"""One error hierarchy for everything sparkdl raises, and the record that carries an error
from a worker to the driver.

Errors are data. Each class names its own fields (``fields``); an error pickles with
them, and :class:`ErrorRecord` carries the class name, the message, those fields and
where it happened (rank, partition, stage attempt) from an executor to the driver as
JSON, where :meth:`ErrorRecord.to_error` rebuilds the same class with the same fields.
Nothing in sparkdl decides anything from the wording of a message.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar


class SparkDLError(Exception):
    """Base class of every error sparkdl raises on purpose.

    Attributes:
        message: what failed, the value, and how to fix it.
        rank, partition, attempt: where it happened, when a worker raised it (else None).
        agreed_by_all_ranks: every rank stopped at the same point of training, so Spark
            must not re-run a stage that would fail alike.
    """

    #: Constructor arguments after ``message``, in order: the error's own fields.
    fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.rank: int | None = None
        self.partition: int | None = None
        self.attempt: int | None = None
        self.agreed_by_all_ranks = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _CLASSES[cls.__name__] = cls

    def field_values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.fields}

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.message, *self.field_values().values())
        return (self.__class__, args, self.__dict__.copy())

    def __str__(self) -> str:
        return self.message


_CLASSES: dict[str, type[SparkDLError]] = {"SparkDLError": SparkDLError}


def error_class(name: str) -> type[SparkDLError] | None:
    """The sparkdl error class called ``name`` (any module's), or None."""
    return _CLASSES.get(name)


def listed(items: Iterable[object], most: int = 5) -> str:
    """A few of ``items`` for a message: the first ``most``, then how many more."""
    items = list(items)
    shown = ", ".join(map(str, items[:most]))
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def agreed(error: SparkDLError) -> SparkDLError:
    """Mark ``error`` as raised by every rank at the same point of training: the task then
    ends normally with the error in its result, and Spark does not re-run a stage that
    would fail alike."""
    error.agreed_by_all_ranks = True
    return error


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

    fields = ("column", "bad_rows")

    def __init__(self, message: str, column: str = "", bad_rows: int = 0) -> None:
        super().__init__(message)
        self.column = column
        self.bad_rows = bad_rows


class PeerStopped(SparkDLError):
    """Another worker rejected its input or stopped training; this worker stopped with it."""


class ClusterConfigError(SparkDLError, RuntimeError):
    """The Spark cluster cannot run the barrier stage as configured (a ``RuntimeError`` too,
    as PySpark's ``TorchDistributor`` raises for missing GPUs: code written for it catches
    that)."""


class ExecutorEnvironmentError(ClusterConfigError):
    """The executors' Python cannot run sparkdl (wrong interpreter, torch or sparkdl missing)."""


class ModelMismatchError(SparkDLError, ValueError):
    """The model, the loss and the data do not fit together (shapes, dtypes, label kind)."""


class RendezvousError(SparkDLError):
    """Workers could not find each other or form a process group."""


class CollectiveError(SparkDLError):
    """A collective operation (all-reduce, broadcast) failed."""


class WaitTimeout(SparkDLError):
    """A bounded wait ran out. Every wait in sparkdl has a bound; its error names what was
    waited for (in the message) and the setting that raises the bound (a field).

    Attributes:
        setting: the setting that raises the bound, e.g. ``"runtime.collective_timeout_s"``.
        limit_s: the bound that ran out, in seconds (None where the raising side does not know it).
    """

    fields: ClassVar[tuple[str, ...]] = ("setting", "limit_s")

    def __init__(self, message: str, setting: str = "", limit_s: float | None = None) -> None:
        super().__init__(message)
        self.setting = setting
        self.limit_s = limit_s


class RendezvousTimeout(WaitTimeout, RendezvousError):
    """The workers did not all meet, or form their process group, within the bound."""


class CollectiveTimeout(WaitTimeout, CollectiveError):
    """A collective waited longer than its bound for a worker that neither arrived nor failed."""


class TeardownError(SparkDLError):
    """A worker could not release its process groups, sockets or threads in time."""


class StageStalledError(WaitTimeout):
    """The training stage made no progress for longer than its bound; fit cancelled it."""


class WorkersLostError(WaitTimeout):
    """The cluster kept fewer task slots than the training stage's workers for longer than
    ``runtime.executor_wait_timeout_s`` (executors lost for good), and fewer than
    ``reliability.min_workers`` to go on with; or fit cancelled the stage to go on with fewer.

    Attributes:
        available: the task slots the cluster had.
        required: the workers the stage needed.
    """

    fields: ClassVar[tuple[str, ...]] = ("setting", "limit_s", "available", "required")

    def __init__(
        self,
        message: str,
        setting: str = "",
        limit_s: float | None = None,
        available: int = 0,
        required: int = 0,
    ) -> None:
        super().__init__(message, setting, limit_s)
        self.available, self.required = available, required


class CheckpointError(SparkDLError):
    """A checkpoint could not be written, or a file in the checkpoint directory was refused."""


class ProtocolError(SparkDLError):
    """A frame on one of the driver's sockets was malformed, unauthenticated, too large,
    or out of order."""


class ServerBusy(ProtocolError):
    """The server turned a handshake away (its pending handshakes were full: a flood at its
    port); a later one gets in, so the client tries again."""


class ConnectionClosed(ProtocolError):
    """The peer closed the connection cleanly between two frames."""


class ParameterServerError(SparkDLError):
    """The parameter server refused a request or could not be reached."""


class PushRejected(ParameterServerError):
    """A push was refused (stale attempt, duplicate clock, wrong size, unknown rank)."""


class PsTimeoutError(WaitTimeout, ParameterServerError):
    """A pull waited longer than ``ps_timeout_s`` for other workers."""


class PsAborted(ParameterServerError):
    """A worker stopped training (e.g. a non-finite loss); the others must stop too."""


class CoordinatorFailed(ParameterServerError):
    """The driver's full-batch coordinator (``optimizer = "lbfgs"`` on the parameter server)
    failed: no worker can go on, and a re-run stage would fail alike."""


class WeightTransferError(SparkDLError):
    """Model weights could not be moved between the driver and an executor."""


class TrainingFailedError(SparkDLError):
    """The training stage failed; ``causes`` maps rank to that rank's error text."""

    fields = ("causes",)

    def __init__(self, message: str, causes: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.causes = {int(rank): str(text) for rank, text in (causes or {}).items()}


class TrainFunctionError(SparkDLError, RuntimeError):
    """The user's own training code failed on a worker (``TorchDistributor.run``,
    ``sparkdl.run``): the exception it raised, or a script's exit status, with the last
    lines it wrote to stderr. A ``RuntimeError`` too, as PySpark's ``TorchDistributor``
    raises when training fails."""

    fields = ("python_type", "exit_code", "output_tail")

    def __init__(
        self, message: str, python_type: str = "", exit_code: int = 1, output_tail: str = ""
    ) -> None:
        super().__init__(message)
        self.python_type = python_type
        self.exit_code = int(exit_code)
        self.output_tail = output_tail


class RunTimeout(WaitTimeout):
    """A run of the user's own code went past the time limit it was given."""


# --------------------------------------------------------------------------- the record

_RECORD_MARK = "sparkdl-error-record"
_RECORD_PATTERN = re.compile(rf"\[{_RECORD_MARK}:([A-Za-z0-9+/=]+)\]")


_CAUSE_CHARS = 500


def _root_cause(error: BaseException, depth: int = 10) -> BaseException:
    """The innermost error ``error`` was explicitly raised from (``raise ... from``), at most
    ``depth`` links down; ``error`` itself where it has no cause. torch's pipeline schedule,
    for one, raises "Failed to run stage backward" from the allocator's "can't allocate
    memory"."""
    while error.__cause__ is not None and depth > 0:
        error, depth = error.__cause__, depth - 1
    return error


@dataclass(frozen=True)
class ErrorRecord:
    """A worker's error as data: its class, message and fields, and where it happened.

    ``error_type`` is a sparkdl error class name; an error of any other type is recorded
    as :class:`TrainingFailedError` with ``python_type`` naming the original.
    """

    error_type: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)
    rank: int | None = None
    partition: int | None = None
    attempt: int | None = None
    agreed: bool = False
    python_type: str = ""

    @classmethod
    def of(
        cls,
        error: BaseException,
        rank: int | None = None,
        partition: int | None = None,
        attempt: int | None = None,
    ) -> ErrorRecord:
        """The record of ``error`` raised on ``rank`` (its own rank, if it has one, wins)."""
        if isinstance(error, SparkDLError):
            return cls(
                type(error).__name__,
                error.message,
                _jsonable(error.field_values()),
                error.rank if error.rank is not None else rank,
                error.partition if error.partition is not None else partition,
                error.attempt if error.attempt is not None else attempt,
                error.agreed_by_all_ranks,
            )
        text = f"{type(error).__name__}: {error}"
        root = _root_cause(error)
        if root is not error and str(root) not in str(error):  # a library's wrapper hid it
            text += f" (caused by {type(root).__name__}: {str(root)[:_CAUSE_CHARS]})"
        where = f"rank {rank}" if rank is not None else "a worker"
        return cls(
            "TrainingFailedError",
            f"{where} failed: {text}",
            {"causes": {} if rank is None else {rank: text}},
            rank,
            partition,
            attempt,
            python_type=type(error).__qualname__,
        )

    def to_error(self) -> SparkDLError:
        """The same error class with the same fields; where it happened in its attributes."""
        cls = error_class(self.error_type) or TrainingFailedError
        fields = dict(self.fields)
        if cls is TrainingFailedError:
            fields = {"causes": {int(r): t for r, t in fields.get("causes", {}).items()}}
        try:
            error = cls(self.message, **fields)
        except TypeError:  # a record from another sparkdl version: keep the message
            error = TrainingFailedError(self.message)
        error.rank, error.partition, error.attempt = self.rank, self.partition, self.attempt
        error.agreed_by_all_ranks = self.agreed
        return error

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ErrorRecord:
        data = json.loads(text)
        return cls(**data)

    def embed(self) -> str:
        """The record as one token that survives any text channel (Spark's task failure
        message included): base64 JSON between fixed markers."""
        encoded = base64.b64encode(self.to_json().encode()).decode()
        return f"[{_RECORD_MARK}:{encoded}]"

    @classmethod
    def find_embedded(cls, text: str) -> list[ErrorRecord]:
        """Every record embedded in ``text`` (e.g. a Spark job failure), oldest first."""
        records = []
        for encoded in _RECORD_PATTERN.findall(text):
            try:
                records.append(cls.from_json(base64.b64decode(encoded).decode()))
            except (ValueError, TypeError):
                continue  # cut by a log line limit: not a record
        return records


class WorkerFailed(Exception):
    """What a barrier task raises: the human message, then the embedded record for the driver.

    Not a :class:`SparkDLError`: it only carries a record across Spark's task failure path;
    the driver raises ``record.to_error()``.
    """

    def __init__(self, record: ErrorRecord) -> None:
        super().__init__(f"{record.error_type}: {record.message}\n{record.embed()}")
        self.record = record

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.record,))


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(values, default=str))
