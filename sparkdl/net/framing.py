"""Authenticated framing shared by the driver's sockets: a fixed header, raw payload bytes,
a MAC tag. The parameter server (:mod:`sparkdl.ps.protocol`) and the progress channel
(:mod:`sparkdl.progress.protocol`) each speak their own messages over it.

    frame  = prefix || fields || payload || tag
    prefix = magic, framing version, protocol id, kind, payload length   (PREFIX, 16 bytes)
    fields = the protocol's own header fields (one fixed struct per protocol)

The framing knows nothing of what a frame means: a :class:`WireProtocol` names its
kinds and its header fields and maps its messages onto them. No pickle, no JSON: a
payload is raw bytes that the protocol decodes itself.

Reading. A reader looks only at the prefix first: magic, version and protocol id are
compared with its own, the length is checked against ``max_payload`` before a payload
byte is read. Then the tag is verified in constant time; no kind, field or payload
byte is interpreted before it verifies.

Authentication. Keys are derived from the per-fit secret and the protocol's name
(``HMAC-SHA256(secret, "sparkdl-net/<version>/<name>/hello")``, ``.../frame`` likewise),
so a frame of one protocol never verifies as another's. A connection opens with a
HELLO from the client carrying a fresh 16-byte nonce, tagged with HMAC-SHA256 under
the hello key. Every later frame is tagged with Poly1305 under a one-time key
``HMAC-SHA256(frame key, nonce | direction | sequence)``: authenticating hundreds of
MB per second at ~6 GB/s instead of HMAC's ~1 GB/s, and a replayed, reordered or
reflected frame fails to verify because its key differs. A frame leaves in one
``sendmsg`` (header, payload and tag, the payload uncopied) and is read with
``recv_into``.
"""

from __future__ import annotations

import abc
import enum
import functools
import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.poly1305 import Poly1305

from sparkdl.errors import ConnectionClosed, ProtocolError

Payload = bytes | bytearray | memoryview
Fields = tuple[int, ...]
M = TypeVar("M")
E = TypeVar("E", bound=enum.IntEnum)

#: Where a frame's payload is read to, by (kind, header fields, length): a writable view of
#: exactly ``length`` bytes, or None for a fresh buffer.
Placement = Callable[[int, Fields, int], "memoryview | None"]

#: The secret a HELLO must verify under, chosen by its (not yet authenticated) header fields;
#: None refuses the connection. Lets one server hold a secret per resource it serves.
SecretLookup = Callable[[Fields], "bytes | None"]

MAGIC = b"SDNT"
VERSION = 3
PREFIX = struct.Struct("<4sBBBxQ")  # magic, version, protocol id, kind, (pad), payload length
NONCE_BYTES = 16
HELLO_TAG_BYTES = 32  # HMAC-SHA256
TAG_BYTES = 16  # Poly1305
_KIND = 3  # index of the kind in an unpacked header; the protocol's fields start at _FIELDS
_KIND_OFFSET = 6  # byte offset of the kind in the prefix
_FIELDS = 5


class WireProtocol(abc.ABC, Generic[M]):
    """One protocol spoken over the framing: its identity, header fields and messages.

    Subclasses say how a message maps onto (kind, header fields, payload) and back.

    Args:
        name: the protocol's name, bound into every key: a frame of another protocol
            never verifies, even one that forged this protocol's id byte.
        ident: the prefix's protocol id (another protocol's frame is refused by it, early).
        fields: ``struct`` format, without byte order, of the header fields after the prefix.
        hello_kind: the kind a connection opens with.
        oversize_hint: how to raise the payload cap, for the error of an oversized frame.
    """

    def __init__(self, name: str, ident: int, fields: str, hello_kind: int, oversize_hint: str = "") -> None:
        self.name = name
        self.ident = ident
        self.header = struct.Struct(PREFIX.format + fields)
        self.hello_kind = hello_kind
        self.oversize_hint = oversize_hint
        self.domain = f"sparkdl-net/{VERSION}/{name}".encode()

    @abc.abstractmethod
    def encode(self, message: M) -> tuple[int, Fields, Payload]:
        """The kind, header fields and payload of ``message``."""

    @abc.abstractmethod
    def decode(self, kind: int, fields: Fields, payload: bytearray) -> M:
        """The message of an authenticated frame.

        Raises:
            ProtocolError: a kind, field value or payload size this protocol does not know.
        """

    def pack(self, kind: int, fields: Fields, length: int) -> bytes:
        """The header of a frame of ``kind`` with ``fields`` and ``length`` payload bytes."""
        return self.header.pack(MAGIC, VERSION, self.ident, kind, length, *fields)


def member(kinds: type[E], value: int, protocol: str) -> E:
    """``kinds(value)``, or a ProtocolError naming the protocol and the value."""
    found = _members(kinds).get(value)
    if found is None:
        raise ProtocolError(f"unknown {protocol} {kinds.__name__} {value}")
    return found


@functools.cache
def _members(kinds: type[E]) -> dict[int, E]:
    """Value -> member: a dict lookup per frame instead of the slower ``Enum.__call__``."""
    return {int(m): m for m in kinds}


class _Keys:
    """The keys of one protocol under one secret: the HELLO's, and the root of the frame keys."""

    def __init__(self, secret: bytes, protocol: WireProtocol) -> None:
        self.hello = hmac.new(secret, protocol.domain + b"/hello", hashlib.sha256).digest()
        frame_root = hmac.new(secret, protocol.domain + b"/frame", hashlib.sha256).digest()
        self._frame = hmac.new(frame_root, digestmod=hashlib.sha256)  # keyed once, copied per frame

    def hello_tag(self, header: bytes | bytearray, nonce: bytes | bytearray) -> bytes:
        return hmac.new(self.hello, bytes(header) + bytes(nonce), hashlib.sha256).digest()

    def frame(self, nonce: bytes, direction: bytes, seq: int) -> bytes:
        mac = self._frame.copy()
        mac.update(nonce + direction + seq.to_bytes(8, "little"))
        return mac.digest()


class Channel(Generic[M]):
    """One authenticated connection: sends and receives one protocol's messages.

    Not thread-safe: one thread (or a lock) per channel.

    Args:
        sock: the connected socket.
        secret: the per-fit secret.
        protocol: the protocol spoken on it.
        nonce: the connection nonce from the HELLO.
        client: True on the side that sent the HELLO (it sends with direction ``c``).
    """

    def __init__(
        self, sock: socket.socket, secret: bytes, protocol: WireProtocol[M], nonce: bytes, client: bool
    ) -> None:
        self.sock = sock
        self.protocol = protocol
        self._keys = _Keys(secret, protocol)
        self._nonce = nonce
        self._send_dir, self._recv_dir = (b"c", b"s") if client else (b"s", b"c")
        self._send_seq = 0
        self._recv_seq = 0

    def send(self, message: M) -> int:
        """Send one frame without copying its payload; return the bytes sent."""
        kind, fields, data = self.protocol.encode(message)
        payload = memoryview(data).cast("B")
        header = self.protocol.pack(kind, fields, payload.nbytes)
        mac = Poly1305(self._keys.frame(self._nonce, self._send_dir, self._send_seq))
        mac.update(header)
        mac.update(payload)
        tag = mac.finalize()
        self._send_seq += 1
        _send_parts(self.sock, [memoryview(header), payload, memoryview(tag)])
        return len(header) + payload.nbytes + len(tag)

    def recv(self, max_payload: int, into: Placement | None = None) -> M:
        """Read, authenticate and decode the next frame.

        Args:
            max_payload: the largest payload accepted (checked before it is read).
            into: where a payload goes, by the frame's kind, header fields and length:
                the socket then reads straight into that memory (the kernel writes it:
                no buffer, no copy), which holds unverified bytes until the tag checks.

        Raises:
            ConnectionClosed: the peer closed the connection between two frames.
            ProtocolError: a bad prefix, a length over ``max_payload``, a truncated
                frame, a tag that does not verify, or a message the protocol refuses.
        """
        header, payload, tag = read_raw(self.sock, self.protocol, max_payload, TAG_BYTES, into)
        mac = Poly1305(self._keys.frame(self._nonce, self._recv_dir, self._recv_seq))
        mac.update(header)
        mac.update(payload)
        try:
            mac.verify(bytes(tag))
        except InvalidSignature:
            raise ProtocolError(
                f"{self.protocol.name} frame failed authentication (wrong secret or protocol, "
                "or a replayed, reordered or reflected frame)"
            ) from None
        self._recv_seq += 1
        values = self.protocol.header.unpack(header)
        return self.protocol.decode(values[_KIND], values[_FIELDS:], payload)


def client_hello(sock: socket.socket, secret: bytes, protocol: WireProtocol[M], hello: M) -> Channel[M]:
    """Open a connection with ``hello`` (a message of the protocol's HELLO kind); the
    caller then reads the protocol's answer on the returned channel."""
    kind, fields, payload = protocol.encode(hello)
    if kind != protocol.hello_kind or len(payload):
        raise ValueError(f"a {protocol.name} connection opens with a HELLO without payload, not kind {kind}")
    nonce = os.urandom(NONCE_BYTES)
    header = protocol.pack(kind, fields, NONCE_BYTES)
    keys = _Keys(secret, protocol)
    sock.sendall(header + nonce + keys.hello_tag(header, nonce))
    return Channel(sock, secret, protocol, nonce, client=True)


def server_hello(
    sock: socket.socket, secret: bytes | SecretLookup, protocol: WireProtocol[M]
) -> tuple[M, Channel[M]]:
    """Read and verify a client's HELLO; return it and the server's side of the channel.

    Args:
        secret: the secret, or a lookup from the HELLO's header fields to the secret of
            the resource it names (the fields are only trusted once the tag verifies).

    Raises:
        ConnectionClosed: the peer closed before sending anything.
        ProtocolError: not a HELLO of ``protocol`` under ``secret``.
    """
    header, nonce, tag = read_raw(sock, protocol, NONCE_BYTES, HELLO_TAG_BYTES)
    values = protocol.header.unpack(header)
    key = secret if isinstance(secret, bytes) else secret(values[_FIELDS:])
    if key is None or not hmac.compare_digest(bytes(tag), _Keys(key, protocol).hello_tag(header, nonce)):
        raise ProtocolError(f"{protocol.name} HELLO failed authentication (wrong or missing job secret)")
    if values[_KIND] != protocol.hello_kind or len(nonce) != NONCE_BYTES:
        raise ProtocolError(f"first {protocol.name} frame was of kind {values[_KIND]}, expected a HELLO")
    hello = protocol.decode(values[_KIND], values[_FIELDS:], bytearray())
    return hello, Channel(sock, key, protocol, bytes(nonce), client=False)


def read_raw(
    sock: socket.socket,
    protocol: WireProtocol,
    max_payload: int,
    tag_bytes: int,
    into: Placement | None = None,
) -> tuple[bytearray, Any, bytearray]:
    """Header, payload and tag of one frame; only the prefix (and, for ``into``, the
    header's fields) is looked at before the tag verifies.

    Raises:
        ConnectionClosed: a clean EOF before the frame's first byte.
        ProtocolError: a bad prefix, a length over ``max_payload`` (before the payload
            is read), or a stream that ends inside the frame.
    """
    header = _recv_exactly(sock, protocol.header.size, at_frame_start=True)
    magic, version, ident, _, length = PREFIX.unpack_from(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a sparkdl {protocol.name} peer")
    if version != VERSION:
        raise ProtocolError(
            f"framing version {version}, expected {VERSION}: the driver and the executors run "
            "different sparkdl versions"
        )
    if ident != protocol.ident:
        raise ProtocolError(
            f"a frame of protocol {ident} on a {protocol.name} connection (protocol {protocol.ident})"
        )
    if length > max_payload:
        hint = f"; {protocol.oversize_hint}" if protocol.oversize_hint else ""
        raise ProtocolError(
            f"{protocol.name} frame announces {length} payload bytes, over the cap of {max_payload}{hint}"
        )
    target = into(header[_KIND_OFFSET], protocol.header.unpack(header)[_FIELDS:], length) if into else None
    if target is None:
        payload: Any = _recv_exactly(sock, length)
    else:
        _recv_into(sock, target, length)
        payload = target
    return header, payload, _recv_exactly(sock, tag_bytes)


def _send_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    """Send header, payload and tag in one ``sendmsg`` (more only if the kernel takes part)."""
    parts = [p for p in parts if p.nbytes]
    while parts:
        sent = sock.sendmsg(parts)
        while parts and sent >= parts[0].nbytes:
            sent -= parts[0].nbytes
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]


def _recv_exactly(sock: socket.socket, count: int, at_frame_start: bool = False) -> bytearray:
    buffer = bytearray(count)
    _recv_into(sock, memoryview(buffer), count, at_frame_start)
    return buffer


def _recv_into(sock: socket.socket, view: memoryview, count: int, at_frame_start: bool = False) -> None:
    if view.nbytes != count:
        raise ValueError(f"a payload of {count} bytes cannot be read into {view.nbytes} bytes")
    received = 0
    while received < count:
        n = sock.recv_into(view[received:], count - received)
        if n == 0:
            if received == 0 and at_frame_start:
                raise ConnectionClosed("the peer closed the connection")
            raise ProtocolError(f"connection closed after {received} of {count} bytes (truncated frame)")
        received += n
