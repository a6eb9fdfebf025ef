"""The weights channel's messages, on the authenticated framing of :mod:`sparkdl.wire.framing`.

Header fields (after the framing prefix), the same three on every frame:

    op      UPLOAD (a fit's rank 0 sends the trained weights) or DOWNLOAD (an inference
            task fetches a model's weights)
    slot    what is moved: the fit's upload slot, or the offered model; each slot has
            its own secret, which its HELLO must verify under
    value   CHUNK: the stream offset of its first byte; DONE and the final ACK: the
            stream's total bytes; otherwise 0

Kinds and payloads:

    HELLO     client -> driver: opens the connection; empty (the nonce is the framing's)
    ACK       driver -> client: the HELLO was accepted (value 0), or, after an upload's
              DONE, the weights were received whole (value = total bytes)
    MANIFEST  sender -> receiver: the state dict's entries (:mod:`sparkdl.services.weights.codec`)
    CHUNK     sender -> receiver: the next bytes of the tensors' stream
    DONE      sender -> receiver: the stream is complete; empty
"""

from __future__ import annotations

import contextlib
import enum
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from sparkdl import wire
from sparkdl.errors import ProtocolError
from sparkdl.services.weights.codec import (
    Entry,
    StateAssembler,
    byte_chunks,
    decode_manifest,
    encode_manifest,
    manifest_of,
    total_bytes,
)
from sparkdl.wire.framing import Channel, Fields, Payload, PayloadPlacement, WireProtocol, member

#: A slot's budget: called with the bytes a step of an upload will hold and what they are
#: for, before they are allocated, it raises ProtocolError to refuse them; its context lasts
#: that step.
Reserve = Callable[[int, str], contextlib.AbstractContextManager[None]]

CHUNK_BYTES = 4 * 1024 * 1024
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_PAYLOAD = max(CHUNK_BYTES, MAX_MANIFEST_BYTES)

#: What a manifest costs the receiver besides its tensors' bytes, reserved from the slot's
#: budget so that a peer holding the slot's secret cannot make the driver hold more than the
#: budget with manifests alone (300,000 empty tensors counted 0 bytes and held 269 MB).
#: While it is read and parsed: this many bytes per byte of its frame, reserved from the
#: frame's authenticated header before its payload is read. Measured (tracemalloc peak of
#: ``decode_manifest``, CPython 3.11): a real manifest 11 to 15 times its bytes, the worst JSON
#: found (lists nested deep) 45 times; and the frame's buffer and its copy.
MANIFEST_PARSE_FACTOR = 48
#: While the upload lasts: this many bytes per entry, on top of its tensor's bytes. Measured
#: (resident memory of 200,000 entries): the entry, its name and shape about 570 bytes, its
#: tensor and the byte view the chunks land in about 1,330 (440 for an empty tensor).
ENTRY_BYTES = 2048


class Op(enum.IntEnum):
    UPLOAD = 1
    DOWNLOAD = 2


class Kind(enum.IntEnum):
    HELLO = 1
    ACK = 2
    MANIFEST = 3
    CHUNK = 4
    DONE = 5


@dataclass(frozen=True)
class Hello:
    op: Op
    slot: int


@dataclass(frozen=True)
class Ack:
    op: Op
    slot: int
    total: int = 0


@dataclass(frozen=True)
class Manifest:
    op: Op
    slot: int
    payload: bytes


@dataclass(frozen=True)
class Chunk:
    op: Op
    slot: int
    offset: int
    data: Payload


@dataclass(frozen=True)
class Done:
    op: Op
    slot: int
    total: int


Message = Hello | Ack | Manifest | Chunk | Done


class _WeightsWire(WireProtocol[Message]):
    """Maps the weights messages onto the framing: header fields op, slot and value."""

    def encode(self, message: Message) -> tuple[int, Fields, Payload]:
        if isinstance(message, Chunk):
            return Kind.CHUNK, (message.op, message.slot, message.offset), message.data
        if isinstance(message, Manifest):
            return Kind.MANIFEST, (message.op, message.slot, 0), message.payload
        if isinstance(message, Done):
            return Kind.DONE, (message.op, message.slot, message.total), b""
        if isinstance(message, Ack):
            return Kind.ACK, (message.op, message.slot, message.total), b""
        return Kind.HELLO, (message.op, message.slot, 0), b""

    def decode(self, kind: int, fields: Fields, payload: bytearray) -> Message:
        op, slot, value = member(Op, fields[0], self.name), fields[1], fields[2]
        which = member(Kind, kind, self.name)
        if which is Kind.CHUNK:
            return Chunk(op, slot, value, payload)
        if which is Kind.MANIFEST:
            if len(payload) > MAX_MANIFEST_BYTES:
                raise ProtocolError(f"weights MANIFEST of {len(payload)} bytes, over {MAX_MANIFEST_BYTES}")
            return Manifest(op, slot, bytes(payload))
        if payload:
            raise ProtocolError(f"{which.name} with {len(payload)} payload bytes, expected none")
        if which is Kind.DONE:
            return Done(op, slot, value)
        if which is Kind.ACK:
            return Ack(op, slot, value)
        return Hello(op, slot)


WEIGHTS_WIRE = _WeightsWire("sparkdl-weights", ident=3, fields="IQQ", hello_kind=Kind.HELLO)
WeightsChannel = Channel[Message]


def client_hello(
    sock: socket.socket, secret: bytes, op: Op, slot: int, encrypt: bool = False, *, server_key: bytes
) -> WeightsChannel:
    """Open a connection for ``op`` on ``slot`` to the server whose static public key is
    ``server_key``; the driver answers with an ACK."""
    return wire.client_hello(sock, secret, WEIGHTS_WIRE, Hello(op, slot), encrypt, server_key=server_key)


def expect(
    channel: WeightsChannel, kind: type[Message], hello: Hello, into: PayloadPlacement | None = None
) -> Message:
    """The next frame, which must be a ``kind`` of the connection's op and slot (``into``:
    the framing's placement hook, told each frame's length before its payload is read)."""
    message = channel.recv(MAX_PAYLOAD, into)
    if not isinstance(message, kind) or (message.op, message.slot) != (hello.op, hello.slot):
        raise ProtocolError(
            f"expected a weights {kind.__name__} of {hello.op.name} slot {hello.slot}, got "
            f"{type(message).__name__} of {message.op.name} slot {message.slot}"
        )
    return message


def send_state(channel: WeightsChannel, hello: Hello, state: Mapping[str, torch.Tensor]) -> int:
    """Send ``state``: MANIFEST, the tensors' bytes in CHUNKs, DONE; return the stream's bytes."""
    entries, tensors = manifest_of(state)
    channel.send(Manifest(hello.op, hello.slot, encode_manifest(entries)))
    offset = 0
    for data in byte_chunks(tensors, CHUNK_BYTES):
        channel.send(Chunk(hello.op, hello.slot, offset, data))
        offset += data.nbytes
    channel.send(Done(hello.op, hello.slot, offset))
    return offset


def receive_state(
    channel: WeightsChannel, hello: Hello, reserve: Reserve | None = None
) -> tuple[dict[str, torch.Tensor], int]:
    """Receive what :func:`send_state` sends, each chunk copied into its tensor on arrival;
    return the state and the stream's bytes.

    Args:
        reserve: the slot's budget (see :data:`Reserve`): it is asked for the manifest's
            parse before its payload is read, then for what the upload holds (:func:`upload_cost`)
            before any tensor is allocated, for the transfer's length.

    Raises:
        ProtocolError: frames out of order, a stream that disagrees with its manifest, or
            a manifest or an upload over the budget.
    """
    budget = reserve if reserve is not None else _unbounded
    entries = _receive_manifest(channel, hello, budget)
    cost = upload_cost(entries)
    what = (
        f"an upload of {cost} bytes ({total_bytes(entries)} of tensors, {ENTRY_BYTES} for each of "
        f"its {len(entries)} entries)"
    )
    with budget(cost, what):
        return _assemble(channel, hello, StateAssembler(entries))


def upload_cost(entries: list[Entry]) -> int:
    """The bytes receiving ``entries`` holds: the tensors' and :data:`ENTRY_BYTES` per entry."""
    return total_bytes(entries) + ENTRY_BYTES * len(entries)


def _unbounded(nbytes: int, what: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _receive_manifest(channel: WeightsChannel, hello: Hello, reserve: Reserve) -> list[Entry]:
    """The next frame's manifest, decoded. Its parse is reserved from the budget by the
    length its authenticated header announces, before the payload is read, and held until
    the entries are made (the JSON's objects are gone once this returns)."""
    with contextlib.ExitStack() as parsing:

        def reserve_parse(kind: int, fields: Fields, length: int) -> None:
            if kind == Kind.MANIFEST:
                what = f"a manifest of {length} bytes ({MANIFEST_PARSE_FACTOR} per byte to parse)"
                parsing.enter_context(reserve(MANIFEST_PARSE_FACTOR * length, what))
            return None  # the framing reads the payload into its own buffer

        manifest = expect(channel, Manifest, hello, into=reserve_parse)
        assert isinstance(manifest, Manifest)
        return decode_manifest(manifest.payload)


def _assemble(
    channel: WeightsChannel, hello: Hello, assembler: StateAssembler
) -> tuple[dict[str, torch.Tensor], int]:
    placed = 0  # bytes the socket read straight into the tensors for the current frame

    def place(kind: int, fields: Fields, length: int) -> memoryview | None:
        nonlocal placed
        view = assembler.target(length) if kind == Kind.CHUNK and fields[2] == assembler.received else None
        placed = length if view is not None else 0
        return view

    while True:
        message = channel.recv(MAX_PAYLOAD, into=place)
        if (message.op, message.slot) != (hello.op, hello.slot):
            raise ProtocolError(
                f"a weights frame of slot {message.slot} on the connection of slot {hello.slot}"
            )
        if isinstance(message, Done):
            if message.total != assembler.received:
                raise ProtocolError(
                    f"weights DONE announces {message.total} bytes, {assembler.received} arrived"
                )
            return assembler.finish(), assembler.received
        if not isinstance(message, Chunk) or message.offset != assembler.received:
            raise ProtocolError(
                f"expected the weights CHUNK at offset {assembler.received}, got {type(message).__name__}"
            )
        if placed:
            assembler.advance(placed)
        else:
            assembler.add(message.data)
