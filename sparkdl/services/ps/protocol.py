"""The parameter server's messages, on the authenticated framing of :mod:`sparkdl.wire.framing`.

A frame's payload is the raw little-endian float32 bytes of one shard (PUSH, WEIGHTS),
a UTF-8 text (ABORT, ERROR) or nothing. Its header fields, each with one meaning:

    dtype      PUSH, WEIGHTS: the payload's encoding (FLOAT32, or a codec's code: a
               compressed push, bf16 weights); PULL: the encoding the worker asks for
    error      ERROR: what failed (:class:`ErrorCode`); NONE on every other frame
    shard      the shard a request or its answer is about
    rank       the worker (HELLO and every request)
    attempt    that worker's stage attempt (HELLO and every request)
    clock      the global step a request is about: HELLO the step the workers resumed
               from (0 when they start afresh), PUSH the step the gradient is of, PULL
               the step the worker is about to compute, SNAPSHOT the step to save at
    rows       PUSH: the rows the gradient sum covers; ACK of an independent task's HELLO
               (``ps_barrier = false``: its ``rank`` is its partition, its ``attempt`` Spark's
               task attempt): the partition's rows whose pushes the server applied
    version    WEIGHTS: the weights' version; ACK of a SNAPSHOT: the version saved
    staleness  ACK of a PUSH: how many updates the pushed gradient was behind (sync with
               backup workers: how many clocks late it came, and was dropped);
               WEIGHTS: how many clocks past the one pulled the weights already are;
               PUSH of an independent task: the rows of the steps it dropped (a non-finite
               loss or gradient) since its last push, counted as covered, not trained (its
               retry skips them with the rest)
    area       HELLO: 1 asks for a shared-memory area (the worker mapped the server's
               segment, :mod:`sparkdl.comm.ps_areas`); the ACK of a HELLO: the area granted,
               plus one (0: none, payloads travel in the frames); PUSH, PULL, WEIGHTS:
               the connection's area plus one when the payload is there instead of in the
               frame (PULL: the worker wants the answer there), 0 otherwise
    area_bytes PUSH, WEIGHTS through an area: the payload's bytes there (checked as a
               frame's length is); 0 otherwise
    loss       PUSH of a full-batch pass (optimizer lbfgs): the loss summed over the rows it
               covers, a float64 (the driver's line search needs the objective); 0 otherwise

Errors are data: an ERROR frame carries an :class:`ErrorCode` and the message, and the
worker raises the class the code names (:func:`error_of`), never deciding from wording.
"""

from __future__ import annotations

import enum
import socket
import struct
from typing import NamedTuple

from sparkdl import wire
from sparkdl.errors import (
    CheckpointError,
    CoordinatorFailed,
    ParameterServerError,
    PeerStopped,
    ProtocolError,
    PsAborted,
    PsTimeoutError,
    PushRejected,
    SparkDLError,
    agreed,
)
from sparkdl.wire.framing import Channel, Fields, Payload, WireProtocol, member

FLOAT32 = 1
BF16 = 5  # the bf16 codec's code (sparkdl.comm.compression.codecs.Half): what a pull may ask for
MAX_ERROR_BYTES = 8000


class Kind(enum.IntEnum):
    HELLO = 1  # worker -> server: rank, attempt and the resume step (clock); answered by ACK
    PUSH = 2  # worker -> server: rows-weighted gradient sum of one shard at a clock; answered by ACK
    PULL = 3  # worker -> server: weights of one shard for a clock; answered by WEIGHTS
    WEIGHTS = 4  # server -> worker: the shard's weights and their version
    ACK = 5  # server -> worker: the request was carried out
    ERROR = 6  # server -> worker: the request failed: an ErrorCode and the UTF-8 message
    SNAPSHOT = 7  # rank 0 -> server: save the shard as of global step ``clock``; answered by ACK
    ABORT = 8  # worker -> server: this worker stops (payload: why); every later pull and push fails
    FINISHED = 9  # server -> worker, for a PULL: the full-batch run ended; no pass is left to compute


class ErrorCode(enum.IntEnum):
    """What an ERROR frame reports; the worker raises the class each code names."""

    NONE = 0  # not an ERROR frame
    REFUSED = 1  # any other refusal: ParameterServerError
    REJECTED = 2  # a push or stage attempt was refused: PushRejected
    TIMEOUT = 3  # a pull waited past ps_timeout_s: PsTimeoutError
    ABORTED = 4  # a worker stopped training; the others stop with it: PeerStopped (agreed)
    CHECKPOINT = 5  # a snapshot could not be saved or restored: CheckpointError
    FAILED = 6  # the driver's full-batch coordinator failed; every worker stops: CoordinatorFailed (agreed)


class Frame(NamedTuple):
    """One parameter-server message; see the module docstring for what each field means.

    A named tuple, not a frozen dataclass: one is built for every frame on the hot path,
    and a frozen dataclass of these fields costs about 2 us to build, a tuple 0.4 us.
    """

    kind: Kind
    shard: int = 0
    rank: int = 0
    attempt: int = 0
    clock: int = 0
    rows: int = 0
    payload: Payload = b""
    dtype: int = FLOAT32
    version: int = 0
    staleness: int = 0
    error: ErrorCode = ErrorCode.NONE
    area: int = 0
    area_bytes: int = 0
    loss: float = 0.0


_FLOAT64 = struct.Struct("<d")
_BITS = struct.Struct("<Q")


class _PsWire(WireProtocol[Frame]):
    """Maps :class:`Frame` onto the framing: dtype, error, shard, rank, attempt, clock,
    rows, version, staleness, area, area_bytes, loss (its float64 bits)."""

    def encode(self, message: Frame) -> tuple[int, Fields, Payload]:
        fields = (
            message.dtype,
            int(message.error),
            message.shard,
            message.rank,
            message.attempt,
            message.clock,
            message.rows,
            message.version,
            message.staleness,
            message.area,
            message.area_bytes,
            _BITS.unpack(_FLOAT64.pack(message.loss))[0] if message.loss else 0,
        )
        return int(message.kind), fields, message.payload

    def decode(self, kind: int, fields: Fields, payload: bytearray) -> Frame:
        dtype, error, shard, rank, attempt, clock, rows, version, staleness, area, area_bytes, loss = fields
        frame = Frame(
            member(Kind, kind, self.name),
            shard,
            rank,
            attempt,
            clock,
            rows,
            payload,
            dtype,
            version,
            staleness,
            member(ErrorCode, error, self.name),
            area,
            area_bytes,
            _FLOAT64.unpack(_BITS.pack(loss))[0] if loss else 0.0,
        )
        if (frame.kind is Kind.ERROR) != (frame.error is not ErrorCode.NONE):
            raise ProtocolError(f"{frame.kind.name} frame with error code {frame.error.name}")
        return frame


PS_WIRE = _PsWire(
    "sparkdl-ps",
    ident=1,
    fields="BBHIIQQQQIQQ",
    hello_kind=Kind.HELLO,
    oversize_hint="raise ps_max_frame_mb if the model's largest shard is bigger",
)
PsChannel = Channel[Frame]


def client_hello(
    sock: socket.socket,
    secret: bytes,
    rank: int,
    attempt: int,
    start_clock: int = 0,
    encrypt: bool = False,
    pushers: int = 0,
    want_area: bool = False,
    *,
    server_key: bytes,
) -> PsChannel:
    """Open a connection as worker ``rank``; the caller then expects an ACK on the channel.

    ``start_clock`` > 0 says the workers resumed from the checkpoint of that step;
    ``pushers`` > 0 that the attempt pushes through that many pushers (a HELLO's ``rows``),
    ``rank`` being this one's number among them; ``want_area`` asks for a shared-memory area;
    ``server_key`` is the server's static public key (:class:`~sparkdl.wire.framing.ServerKey`).
    """
    hello = Frame(
        Kind.HELLO, rank=rank, attempt=attempt, clock=start_clock, rows=pushers, area=int(want_area)
    )
    return wire.client_hello(sock, secret, PS_WIRE, hello, encrypt, server_key=server_key)


_CODES: tuple[tuple[type[SparkDLError], ErrorCode], ...] = (
    (PsAborted, ErrorCode.ABORTED),
    (CoordinatorFailed, ErrorCode.FAILED),
    (PsTimeoutError, ErrorCode.TIMEOUT),
    (PushRejected, ErrorCode.REJECTED),
    (CheckpointError, ErrorCode.CHECKPOINT),
)
_CLASSES: dict[ErrorCode, type[SparkDLError]] = {
    ErrorCode.REJECTED: PushRejected,
    ErrorCode.CHECKPOINT: CheckpointError,
}


def error_frame(error: SparkDLError, shard: int = 0) -> Frame:
    """The ERROR frame that tells a worker about ``error``: its code and its message."""
    code = next((code for cls, code in _CODES if isinstance(error, cls)), ErrorCode.REFUSED)
    message = str(error).encode()[:MAX_ERROR_BYTES]
    return Frame(Kind.ERROR, shard=shard, payload=message, error=code)


def error_of(frame: Frame, rank: int) -> SparkDLError:
    """The error worker ``rank`` raises for an ERROR frame: the class its code names.

    ABORTED becomes :class:`PeerStopped`, marked as agreed by every rank (they all stop
    with the worker that stopped); TIMEOUT keeps the server's message, which already
    names the rank and the workers waited for.
    """
    message = bytes(frame.payload).decode(errors="replace")
    if frame.error is ErrorCode.ABORTED:
        return agreed(PeerStopped(f"rank {rank}: {message}"))
    if frame.error is ErrorCode.FAILED:  # the driver's error is the cause: Spark must not re-run
        return agreed(CoordinatorFailed(f"rank {rank}: {message}"))
    if frame.error is ErrorCode.TIMEOUT:
        return PsTimeoutError(message, setting="parameter_server.ps_timeout_s")
    cls = _CLASSES.get(frame.error, ParameterServerError)
    return cls(f"rank {rank}: the parameter server refused the request: {message}")
