"""The meeting point's messages, on the authenticated framing of :mod:`sparkdl.wire.framing`.

Header fields, the same three on every frame:

    task    the worker's task (Spark's ``taskAttemptId``): the driver knows, and the task
            does not, which stage attempt it runs in
    rank    the worker's rank
    world   how many ranks meet (the stage's tasks)

Kinds and payloads:

    HELLO      worker -> driver: opens the connection; empty
    ACK        driver -> worker: the HELLO was accepted; empty
    SAY        worker -> driver: what this rank tells the others, UTF-8, at most
               :data:`MAX_MESSAGE_BYTES`
    MET        driver -> worker: every rank's message in rank order, each behind its
               length (uint32)
    TIMED_OUT  driver -> worker: the ranks that did not arrive in time, UTF-8
    REFUSED    driver -> worker: why this rank cannot meet (its task is not of a stage
               attempt the driver saw, its stage attempt met already, ...), UTF-8
"""

from __future__ import annotations

import enum
import socket
import struct
from dataclasses import dataclass

from sparkdl import wire
from sparkdl.errors import ProtocolError
from sparkdl.wire.framing import Channel, Fields, Payload, WireProtocol, member

#: The most one rank may say: its address, its probe's, its task (about 120 bytes of JSON),
#: with room for long host names. With the listener's cap on sessions it bounds what the
#: server holds, whoever connects.
MAX_MESSAGE_BYTES = 16 * 1024
#: The most ranks one meeting waits for: each waits on a connection (and a thread) of its own.
MAX_WORLD = 4096
#: The most one meeting holds of its ranks' messages (4,096 ranks of about 120 bytes take
#: 0.5 MiB): its answer, encoded once, is this large at most.
MAX_MEETING_BYTES = 4 * 1024 * 1024
_LENGTH = struct.Struct("<I")


class Kind(enum.IntEnum):
    HELLO = 1
    ACK = 2
    SAY = 3
    MET = 4
    TIMED_OUT = 5
    REFUSED = 6


@dataclass(frozen=True)
class Seat:
    """Who speaks: a task, its rank, and how many ranks meet (every frame's header)."""

    task: int
    rank: int
    world: int


@dataclass(frozen=True)
class Note:
    """A frame of ``kind`` about ``seat``: empty (HELLO, ACK), one text (SAY, TIMED_OUT,
    REFUSED) or every rank's (MET: ``texts`` received, or ``encoded`` to send: a meeting's
    answer is encoded once, however many ranks it goes to)."""

    kind: Kind
    seat: Seat
    texts: tuple[str, ...] = ()
    encoded: bytes = b""

    @property
    def text(self) -> str:
        return self.texts[0] if self.texts else ""


def encode_met(texts: tuple[str, ...]) -> bytes:
    """A MET frame's payload: each message behind its length."""
    return b"".join(_LENGTH.pack(len(data)) + data for data in (t.encode() for t in texts))


class _MeetingWire(WireProtocol[Note]):
    def encode(self, message: Note) -> tuple[int, Fields, Payload]:
        fields = (message.seat.task, message.seat.rank, message.seat.world)
        if message.kind is Kind.MET:
            payload = message.encoded or encode_met(message.texts)
        else:
            payload = message.text.encode()
        return message.kind, fields, payload

    def decode(self, kind: int, fields: Fields, payload: bytearray) -> Note:
        which = member(Kind, kind, self.name)
        seat = Seat(*fields)
        if which in (Kind.HELLO, Kind.ACK):
            if payload:
                raise ProtocolError(f"{which.name} with {len(payload)} payload bytes, expected none")
            return Note(which, seat)
        if which is not Kind.MET:
            return Note(which, seat, (_text(payload, which),))
        texts, at = [], 0
        while at < len(payload):
            if at + _LENGTH.size > len(payload):
                raise ProtocolError("a MET frame ends inside a message's length")
            (length,) = _LENGTH.unpack_from(payload, at)
            at += _LENGTH.size
            if at + length > len(payload):
                raise ProtocolError(f"a MET frame's message of {length} bytes runs past its end")
            texts.append(_text(payload[at : at + length], which))
            at += length
        if len(texts) != seat.world:
            raise ProtocolError(f"a MET frame with {len(texts)} messages for a meeting of {seat.world}")
        return Note(which, seat, tuple(texts))


def _text(data: bytes | bytearray, kind: Kind) -> str:
    """UTF-8, strictly: a text that is not would grow when encoded again (each bad byte to
    three), past what the meeting counted."""
    try:
        return bytes(data).decode()
    except UnicodeDecodeError as exc:
        raise ProtocolError(
            f"a {kind.name} frame's text is not UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None


MEETING_WIRE = _MeetingWire("sparkdl-meeting", ident=4, fields="QII", hello_kind=Kind.HELLO)
MeetingChannel = Channel[Note]


def met_bytes(world: int) -> int:
    """The largest MET frame of a meeting of ``world`` ranks."""
    return min(world * (_LENGTH.size + MAX_MESSAGE_BYTES), MAX_MEETING_BYTES + world * _LENGTH.size)


def client_hello(
    sock: socket.socket, secret: bytes, seat: Seat, encrypt: bool = False, *, server_key: bytes
) -> MeetingChannel:
    """Open a connection for ``seat`` to the server whose static public key is
    ``server_key``; the driver answers with an ACK."""
    return wire.client_hello(
        sock, secret, MEETING_WIRE, Note(Kind.HELLO, seat), encrypt, server_key=server_key
    )
