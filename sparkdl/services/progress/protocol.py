"""The progress channel's messages, on the authenticated framing of :mod:`sparkdl.wire.framing`.

Header fields (after the framing prefix), the same two on every frame:

    rank      the worker the connection belongs to (said in its HELLO)
    attempt   that worker's stage attempt

A frame whose rank or attempt differs from its connection's HELLO is refused. Kinds
and payloads:

    HELLO      worker -> driver: opens the connection; empty (the nonce is the framing's)
    ACK        driver -> worker: the HELLO was accepted; empty. Nothing else is answered.
    REPORT     worker -> driver: the worker's figures for the running epoch, 56 bytes:
               epoch, steps, total_steps (-1 while unknown), samples (int64),
               loss_sum, seconds (float64)
    LOG        worker -> driver: a log record: level (int32), then the UTF-8 text
    HEARTBEAT  worker -> driver: alive with nothing to report; empty
"""

from __future__ import annotations

import enum
import math
import socket
import struct
from dataclasses import dataclass

from sparkdl import wire
from sparkdl.errors import ProtocolError
from sparkdl.services.progress.board import Report
from sparkdl.wire.framing import Channel, Fields, Payload, WireProtocol, member

MAX_PAYLOAD = 64 * 1024
MAX_LOG_CHARS = 8000
# epoch, steps, total_steps, samples, loss_sum, seconds, val_loss (NaN until measured)
REPORT_PAYLOAD = struct.Struct("<qqqqddd")
LOG_LEVEL = struct.Struct("<i")


class Kind(enum.IntEnum):
    HELLO = 1
    ACK = 2
    REPORT = 3
    LOG = 4
    HEARTBEAT = 5
    GOODBYE = 6


@dataclass(frozen=True)
class Hello:
    """A worker opens its connection."""

    rank: int
    attempt: int


@dataclass(frozen=True)
class Ack:
    """The driver accepted the HELLO of worker ``rank``."""

    rank: int
    attempt: int


@dataclass(frozen=True)
class Log:
    """A worker's log record, to be logged again on the driver."""

    rank: int
    attempt: int
    level: int
    text: str


@dataclass(frozen=True)
class Heartbeat:
    """A worker is alive, with nothing to report."""

    rank: int
    attempt: int


@dataclass(frozen=True)
class Goodbye:
    """A worker ends its session: it is done, so its silence from now on means nothing. Only
    this authenticated frame ends a session; a connection that just closes (EOF, a reset)
    ended abnormally, and the driver keeps counting that rank's silence."""

    rank: int
    attempt: int


Message = Hello | Ack | Report | Log | Heartbeat | Goodbye


class _ProgressWire(WireProtocol[Message]):
    """Maps the progress messages onto the framing: header fields rank and attempt."""

    def encode(self, message: Message) -> tuple[int, Fields, Payload]:
        fields = (message.rank, message.attempt)
        if isinstance(message, Report):
            payload = REPORT_PAYLOAD.pack(
                message.epoch,
                message.steps,
                message.total_steps,
                message.samples,
                message.loss_sum,
                message.seconds,
                math.nan if message.val_loss is None else message.val_loss,
            )
            return Kind.REPORT, fields, payload
        if isinstance(message, Log):
            return Kind.LOG, fields, LOG_LEVEL.pack(message.level) + message.text.encode()
        if isinstance(message, Hello):
            return Kind.HELLO, fields, b""
        if isinstance(message, Ack):
            return Kind.ACK, fields, b""
        if isinstance(message, Goodbye):
            return Kind.GOODBYE, fields, b""
        return Kind.HEARTBEAT, fields, b""

    def decode(self, kind: int, fields: Fields, payload: bytearray) -> Message:
        rank, attempt = fields
        which = member(Kind, kind, self.name)
        if which is Kind.REPORT:
            if len(payload) != REPORT_PAYLOAD.size:
                raise ProtocolError(f"REPORT of {len(payload)} bytes, expected {REPORT_PAYLOAD.size}")
            epoch, steps, total, samples, loss_sum, seconds, val_loss = REPORT_PAYLOAD.unpack(payload)
            measured = None if math.isnan(val_loss) else val_loss
            return Report(rank, epoch, attempt, steps, total, samples, loss_sum, seconds, measured)
        if which is Kind.LOG:
            if len(payload) < LOG_LEVEL.size:
                raise ProtocolError(f"LOG of {len(payload)} bytes, shorter than its level")
            (level,) = LOG_LEVEL.unpack_from(payload)
            return Log(rank, attempt, level, payload[LOG_LEVEL.size :].decode(errors="replace"))
        if payload:
            raise ProtocolError(f"{which.name} with {len(payload)} payload bytes, expected none")
        if which is Kind.HELLO:
            return Hello(rank, attempt)
        if which is Kind.ACK:
            return Ack(rank, attempt)
        if which is Kind.GOODBYE:
            return Goodbye(rank, attempt)
        return Heartbeat(rank, attempt)


PROGRESS_WIRE = _ProgressWire("sparkdl-progress", ident=2, fields="II", hello_kind=Kind.HELLO)
ProgressChannel = Channel[Message]


def client_hello(
    sock: socket.socket, secret: bytes, rank: int, attempt: int, encrypt: bool = False, *, server_key: bytes
) -> ProgressChannel:
    """Open a connection as worker ``rank`` to the server whose static public key is
    ``server_key``; the driver answers with an ACK."""
    return wire.client_hello(
        sock, secret, PROGRESS_WIRE, Hello(rank, attempt), encrypt, server_key=server_key
    )
