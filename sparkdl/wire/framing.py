"""Authenticated (optionally encrypted) framing shared by the driver's sockets. The
parameter server (:mod:`sparkdl.services.ps.protocol`), the progress channel
(:mod:`sparkdl.services.progress.protocol`) and the weights server (:mod:`sparkdl.services.weights.protocol`)
each speak their own messages over it.

    challenge = magic, framing version, protocol id, flags, server nonce   (server -> client)
    hello     = header (kind HELLO, length 16) || client nonce || HMAC tag   (client -> server)
    frame     = header || header tag || payload pieces, each followed by its tag   (plain)
              | header || header tag || ciphertext || AEAD tag                 (encrypted)
    header    = magic, framing version, protocol id, kind, payload length (PREFIX, 16 bytes)
                || the protocol's own fields (one fixed struct per protocol)

The framing knows nothing of what a frame means: a :class:`WireProtocol` names its kinds
and header fields and maps its messages onto them. No pickle, no JSON: a payload is raw
bytes that the protocol decodes itself.

Handshake. The server speaks first: a CHALLENGE with a fresh 16-byte nonce. The client
answers with a HELLO carrying its own fresh nonce, tagged with HMAC-SHA256 under the hello
key over the HELLO and the whole challenge. The session's transcript is both nonces, so a
recorded HELLO, or any frame after it, verifies on no other connection: the server's
nonce differs. Keys are derived from the per-fit secret and the protocol's name
(``HMAC-SHA256(secret, "sparkdl-net/<version>/<name>/hello")``, ``.../frame`` likewise),
so a frame of one protocol never verifies as another's.

Frames. Tags are GMAC (AES-256-GCM over an empty plaintext, the tagged bytes as associated
data) under a per-connection key, ``HMAC-SHA256(frame key, transcript | "/mac")``, each
with a nonce of its own: direction, sequence number and what it tags (the header, or a
piece of the payload by its index). A reader authenticates the header before it trusts
its length or fields, so a peer allocates nothing, and places nothing, before it has
proved it holds the secret; a replayed, reordered or reflected frame, or a piece moved
within or between frames, fails because its nonce differs. GMAC runs at about 20 GB/s
here (carry-less multiplication), Poly1305 at 12 GB/s and HMAC at 1 GB/s, and a small tag
takes 0.55 us against Poly1305's 2.5; one key per connection spares each frame the
derivation of one-time keys (1.7 us). Header-only round trips: +45 us over a bare socket
against +104-119 us with version 4's Poly1305 (``benchmarks/bench_framing.py``).
A plaintext payload is tagged in pieces of ``STREAM_CHUNK`` bytes: the sender tags a piece
once the kernel holds it and the reader verifies each as it lands, so that neither side's
hashing waits for the whole payload; an empty payload carries no tag. With ``encrypt``
the payload is AES-256-GCM ciphertext under a second per-connection key
(``HMAC-SHA256(frame key, transcript | "/aead")``), the nonce being direction and
sequence, the header as associated data. A small frame leaves in one ``sendmsg`` (the
plaintext payload uncopied); a piece and its tag are read with one ``recvmsg_into``.
"""

from __future__ import annotations

import abc
import enum
import functools
import hashlib
import hmac
import math
import os
import select
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from sparkdl.errors import ConnectionClosed, ProtocolError

Payload = bytes | bytearray | memoryview
Fields = tuple[int, ...]
M = TypeVar("M")
E = TypeVar("E", bound=enum.IntEnum)

#: Where a frame's payload is read to, by (kind, header fields, length): a writable view of
#: exactly ``length`` bytes, or None for a fresh buffer. Called once the header verified.
Placement = Callable[[int, Fields, int], "memoryview | None"]

#: The secret a HELLO must verify under, chosen by its (not yet authenticated) header fields;
#: None refuses the connection. Lets one server hold a secret per resource it serves.
SecretLookup = Callable[[Fields], "bytes | None"]

MAGIC = b"SDNT"
VERSION = 5
PREFIX = struct.Struct("<4sBBBxQ")  # magic, version, protocol id, kind, (pad), payload length
CHALLENGE = struct.Struct("<4sBBBx16s")  # magic, version, protocol id, flags, (pad), server nonce
ENCRYPTED = 1  # the challenge's flag: every payload of the connection is encrypted
NONCE_BYTES = 16
HELLO_TAG_BYTES = 32  # HMAC-SHA256
TAG_BYTES = 16  # a GMAC tag, or the AES-GCM one
_KIND = 3  # index of the kind in an unpacked header
_LENGTH = 4  # index of the payload length
_FIELDS = 5  # the protocol's fields start here
#: A plaintext payload is tagged in pieces of this size; a larger one is sent piece by piece,
#: each tagged once the kernel holds it, so the sender's hashing overlaps the reader's
#: copying and hashing. Part of the wire format: a change needs a new ``VERSION``. 1 MiB:
#: a 4 MB echo (bench_framing.py) reached 0.55-0.64 of a bare socket's round trips in
#: pieces of 1, 2 or 4 MiB, 0.45-0.50 in pieces of 256 KiB (a syscall and a tag per piece).
STREAM_CHUNK = 1 << 20
_HEADER_TAG = 0xFFFFFFFF  # the nonce's index of a header's tag (a payload piece's is its index)
MAX_FRAME_PAYLOAD = _HEADER_TAG * STREAM_CHUNK  # pieces 0 .. _HEADER_TAG - 1 (about 4 PiB)
MAX_POLL_MS = (1 << 31) - 1  # poll()'s longest wait (about 24.8 days)


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

    @property
    def hello_size(self) -> int:
        """The bytes of a HELLO: header, client nonce, tag (the same for every HELLO)."""
        return self.header.size + NONCE_BYTES + HELLO_TAG_BYTES

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
    """The keys of one protocol under one secret: the HELLO's, and the root of a session's keys."""

    def __init__(self, secret: bytes, protocol: WireProtocol) -> None:
        self.hello = hmac.new(secret, protocol.domain + b"/hello", hashlib.sha256).digest()
        self._root = hmac.new(secret, protocol.domain + b"/frame", hashlib.sha256).digest()

    def hello_tag(self, hello: bytes, challenge: bytes) -> bytes:
        return hmac.new(self.hello, hello + challenge, hashlib.sha256).digest()

    def session(self, transcript: bytes, purpose: bytes) -> AESGCM:
        """A session's AES-256-GCM key for ``purpose`` (``/mac``: the tags, ``/aead``: the
        encrypted payloads), its own per connection."""
        return AESGCM(hmac.new(self._root, transcript + purpose, hashlib.sha256).digest())


class Channel(Generic[M]):
    """One authenticated connection: sends and receives one protocol's messages.

    Not thread-safe: one thread (or a lock) per channel.

    Args:
        sock: the connected socket.
        secret: the per-fit secret.
        protocol: the protocol spoken on it.
        transcript: the session's nonces (the client's, then the server's).
        client: True on the side that sent the HELLO (it sends with direction ``c``).
        encrypt: payloads travel encrypted (AES-256-GCM).
    """

    def __init__(
        self,
        sock: socket.socket,
        secret: bytes,
        protocol: WireProtocol[M],
        transcript: bytes,
        client: bool,
        encrypt: bool = False,
    ) -> None:
        self.sock = sock
        self.protocol = protocol
        keys = _Keys(secret, protocol)
        self._mac = keys.session(transcript, b"/mac")
        self._cipher = keys.session(transcript, b"/aead") if encrypt else None
        self._send_dir, self._recv_dir = (b"c", b"s") if client else (b"s", b"c")
        self._send_seq = 0
        self._recv_seq = 0
        self._poller: select.poll | None = None  # pending(): this socket's readiness
        self._sealed = ReusedBuffer()  # encrypted: the ciphertext sent
        self._tag_read = memoryview(bytearray(TAG_BYTES))  # plain: each payload piece's tag, as it arrives
        self._opened = ReusedBuffer()  # encrypted: the ciphertext received

    @property
    def encrypted(self) -> bool:
        return self._cipher is not None

    def send(self, message: M) -> int:
        """Send one frame (a plaintext payload uncopied); return the bytes sent."""
        return self.send_many((message,))

    def send_many(self, messages: Sequence[M], wait: bool = True) -> int:
        """Send frames back to back; return the bytes sent. Frames whose payloads are at most
        ``STREAM_CHUNK`` leave together in one ``sendmsg``: the reader wakes once for all
        of them, not once per frame (a request and the one behind it; two answers).

        ``wait=False``: raise :class:`BlockingIOError` instead of waiting for room in the
        socket's buffer (a peer that reads none of its answers); only for such small frames,
        on a blocking socket (one with a timeout waits that out first).
        """
        flags = 0 if wait else socket.MSG_DONTWAIT
        frames = []  # every frame encoded and checked before any takes a sequence number
        for message in messages:
            kind, fields, data = self.protocol.encode(message)
            payload = memoryview(data).cast("B")
            if not wait and payload.nbytes > STREAM_CHUNK:
                raise ValueError(f"a frame of {payload.nbytes} payload bytes cannot be sent without waiting")
            _check_length(payload.nbytes)
            frames.append((self.protocol.pack(kind, fields, payload.nbytes), payload))
        parts: list[memoryview] = []
        total = 0
        for index, (header, payload) in enumerate(frames):
            seq = self._send_seq
            self._send_seq += 1
            parts += [memoryview(header), self._tag(seq, _HEADER_TAG, header)]
            total += frame_bytes(len(header), payload.nbytes, self.encrypted)
            if self._cipher is not None:
                sealed = self._sealed.view(payload.nbytes + TAG_BYTES)
                self._cipher.encrypt_into(_aead_nonce(self._send_dir, seq), payload, header, sealed)
                if index + 1 < len(frames):  # the next frame reuses the buffer: send or copy
                    if payload.nbytes > STREAM_CHUNK:
                        _send_parts(self.sock, [*parts, sealed])
                        parts = []
                        continue
                    sealed = memoryview(bytes(sealed))
                parts.append(sealed)
            elif payload.nbytes <= STREAM_CHUNK:
                if payload.nbytes:
                    parts += [payload, self._tag(seq, 0, payload)]
            else:  # stream: tag each piece once the kernel holds it, while the reader copies it out
                for piece, start in enumerate(range(0, payload.nbytes, STREAM_CHUNK)):
                    chunk = payload[start : start + STREAM_CHUNK]
                    _send_parts(self.sock, [*parts, chunk])
                    parts = [self._tag(seq, piece, chunk)]  # leaves with what follows
        _send_parts(self.sock, parts, flags)
        return total

    def pending(self, timeout_s: float = 0.0) -> bool:
        """Whether bytes from the peer (or its end of the connection) have arrived, waiting
        up to ``timeout_s`` for them (0: never waits, whatever the socket's timeout; at
        most ``MAX_POLL_MS``: a longer wait asks again)."""
        if self._poller is None:  # asked every step: made once
            self._poller = select.poll()
            self._poller.register(self.sock, select.POLLIN)
        return bool(self._poller.poll(math.ceil(min(max(timeout_s, 0.0) * 1000, MAX_POLL_MS))))

    def recv(self, max_payload: int, into: Placement | None = None) -> M:
        """Read, authenticate and decode the next frame.

        The header is authenticated before its length or fields are trusted: nothing is
        allocated or placed for a frame whose header does not verify.

        Args:
            max_payload: the largest payload accepted (checked before it is read).
            into: where a payload goes, by the frame's kind, header fields and length:
                the socket then reads straight into that memory (no buffer, no copy when
                not encrypted), which holds unverified bytes until the tag checks.

        Raises:
            ConnectionClosed: the peer closed the connection between two frames.
            ProtocolError: a bad prefix, a header or payload that does not verify, a length
                over ``max_payload``, a truncated frame, or a message the protocol refuses.
        """
        size = self.protocol.header.size
        tagged = _recv_exactly(self.sock, size + TAG_BYTES, at_frame_start=True)  # every frame has both
        header = bytes(tagged[:size])
        check_prefix(header, self.protocol)
        seq = self._recv_seq
        self._verify(seq, _HEADER_TAG, header, memoryview(tagged)[size:])
        values = self.protocol.header.unpack(header)
        kind, length, fields = values[_KIND], values[_LENGTH], values[_FIELDS:]
        _check_length(length)
        if length > max_payload:
            hint = f"; {self.protocol.oversize_hint}" if self.protocol.oversize_hint else ""
            raise ProtocolError(
                f"{self.protocol.name} frame announces {length} payload bytes, "
                f"over the cap of {max_payload}{hint}"
            )
        target = into(kind, fields, length) if into else None
        payload: Any = target if target is not None else bytearray(length)
        view = memoryview(payload).cast("B")  # the placement's memory, whatever its element type
        if view.nbytes != length:
            raise ValueError(f"a payload of {length} bytes cannot be read into {view.nbytes} bytes")
        if self._cipher is None:
            for piece, start in enumerate(range(0, length, STREAM_CHUNK)):  # each verified as it lands
                chunk = view[start : start + STREAM_CHUNK]
                _recv_into(self.sock, [chunk, self._tag_read])
                self._verify(seq, piece, chunk, self._tag_read)
        else:
            sealed = self._opened.view(length + TAG_BYTES)
            _recv_into(self.sock, [sealed])
            try:
                self._cipher.decrypt_into(_aead_nonce(self._recv_dir, seq), sealed, header, view)
            except InvalidTag:
                raise self._refused() from None
        self._recv_seq += 1
        return self.protocol.decode(kind, fields, payload)

    def _tag(self, seq: int, index: int, data: Payload) -> memoryview:
        """The GMAC tag of ``data`` sent as frame ``seq``'s header (``_HEADER_TAG``) or its
        piece ``index``."""
        return memoryview(self._mac.encrypt(_tag_nonce(self._send_dir, seq, index), b"", data))

    def _verify(self, seq: int, index: int, data: Payload, tag: memoryview) -> None:
        try:
            self._mac.decrypt(_tag_nonce(self._recv_dir, seq, index), tag, data)
        except InvalidTag:
            raise self._refused() from None

    def _refused(self) -> ProtocolError:
        return ProtocolError(
            f"{self.protocol.name} frame failed authentication (wrong secret or protocol, "
            "or a replayed, reordered or reflected frame)"
        )


def frame_bytes(header_bytes: int, payload_bytes: int, encrypted: bool = False) -> int:
    """The bytes a frame takes on the wire: header, its tag, payload and the payload's tags
    (one per ``STREAM_CHUNK`` piece when plain, none for an empty one; one when encrypted)."""
    tags = 1 if encrypted else -(-payload_bytes // STREAM_CHUNK)
    return header_bytes + TAG_BYTES + payload_bytes + tags * TAG_BYTES


def _tag_nonce(direction: bytes, seq: int, index: int) -> bytes:
    """A tag's nonce: unique per connection key while ``seq`` < 2**56 (past it, to_bytes
    raises) and a piece's index stays under ``_HEADER_TAG`` (:func:`_check_length`)."""
    return direction + seq.to_bytes(7, "little") + index.to_bytes(4, "little")


def _check_length(length: int) -> None:
    """Refuse a payload with a piece whose index would be the header's (about 4 PiB): its
    tag's nonce would repeat the header's."""
    if length > MAX_FRAME_PAYLOAD:
        raise ProtocolError(
            f"a frame of {length} payload bytes: the framing carries at most {MAX_FRAME_PAYLOAD}"
        )


def _aead_nonce(direction: bytes, seq: int) -> bytes:
    return direction + seq.to_bytes(11, "little")


class ReusedBuffer:
    """Memory read or written into frame after frame, grown as needed: fresh memory for
    every frame pays its first-touch page faults every time (on the benchmark VM up to
    2.4 ms per MB). A view is valid until the next :meth:`view`."""

    def __init__(self) -> None:
        self._data = bytearray()

    def view(self, size: int) -> memoryview:
        """Exactly ``size`` bytes of the buffer."""
        if len(self._data) < size:
            self._data = bytearray(size)
        return memoryview(self._data)[:size]


def server_challenge(protocol: WireProtocol, encrypt: bool = False) -> bytes:
    """The CHALLENGE a server sends first on a new connection: a fresh nonce, and whether
    the connection is encrypted."""
    return CHALLENGE.pack(
        MAGIC, VERSION, protocol.ident, ENCRYPTED if encrypt else 0, os.urandom(NONCE_BYTES)
    )


def client_hello(
    sock: socket.socket, secret: bytes, protocol: WireProtocol[M], hello: M, encrypt: bool = False
) -> Channel[M]:
    """Read the server's challenge and answer with ``hello`` (a message of the protocol's
    HELLO kind); the caller then reads the protocol's answer on the returned channel.

    Raises:
        ProtocolError: the server closed before its challenge (it refused the connection),
            is not a sparkdl server of ``protocol``, or disagrees about encryption.
    """
    kind, fields, payload = protocol.encode(hello)
    if kind != protocol.hello_kind or len(payload):
        raise ValueError(f"a {protocol.name} connection opens with a HELLO without payload, not kind {kind}")
    try:
        challenge = bytes(_recv_exactly(sock, CHALLENGE.size, at_frame_start=True))
    except ConnectionClosed:
        raise ProtocolError(
            f"the {protocol.name} server closed the connection before its challenge: it refused it "
            "(over its connection cap, or shutting down)"
        ) from None
    magic, version, ident, flags, server_nonce = CHALLENGE.unpack(challenge)
    _check_identity(magic, version, ident, protocol)
    if bool(flags & ENCRYPTED) != encrypt:
        raise ProtocolError(
            f"the {protocol.name} server {'encrypts' if flags & ENCRYPTED else 'does not encrypt'} "
            f"but this worker was told {'to' if encrypt else 'not to'}: the driver and the executors "
            "disagree about runtime.encrypt"
        )
    nonce = os.urandom(NONCE_BYTES)
    header = protocol.pack(kind, fields, NONCE_BYTES)
    sock.sendall(header + nonce + _Keys(secret, protocol).hello_tag(header + nonce, challenge))
    return Channel(sock, secret, protocol, nonce + server_nonce, client=True, encrypt=encrypt)


def accept_hello(
    sock: socket.socket,
    raw: bytes | bytearray,
    challenge: bytes,
    secret: bytes | SecretLookup,
    protocol: WireProtocol[M],
) -> tuple[M, Channel[M]]:
    """Verify a client's HELLO (``raw``: ``protocol.hello_size`` bytes, read after this
    server sent ``challenge``); return it and the server's side of the channel.

    Args:
        secret: the secret, or a lookup from the HELLO's header fields to the secret of
            the resource it names (the fields are only trusted once the tag verifies).

    Raises:
        ProtocolError: not a HELLO of ``protocol`` under ``secret`` answering ``challenge``.
    """
    raw = bytes(raw)
    size = protocol.header.size
    header, nonce, tag = raw[:size], raw[size : size + NONCE_BYTES], raw[size + NONCE_BYTES :]
    check_prefix(header, protocol)
    values = protocol.header.unpack(header)
    if values[_KIND] != protocol.hello_kind or values[_LENGTH] != NONCE_BYTES:
        raise ProtocolError(f"first {protocol.name} frame was of kind {values[_KIND]}, expected a HELLO")
    key = secret if isinstance(secret, bytes) else secret(values[_FIELDS:])
    if key is None or not hmac.compare_digest(tag, _Keys(key, protocol).hello_tag(header + nonce, challenge)):
        raise ProtocolError(
            f"{protocol.name} HELLO failed authentication (wrong or missing job secret, or a replayed HELLO)"
        )
    hello = protocol.decode(values[_KIND], values[_FIELDS:], bytearray())
    encrypt = bool(CHALLENGE.unpack(challenge)[3] & ENCRYPTED)
    return hello, Channel(
        sock, key, protocol, nonce + challenge[-NONCE_BYTES:], client=False, encrypt=encrypt
    )


def server_hello(
    sock: socket.socket, secret: bytes | SecretLookup, protocol: WireProtocol[M], encrypt: bool = False
) -> tuple[M, Channel[M]]:
    """The server's side of a handshake on one blocking socket: send a challenge, read and
    verify the HELLO (the listener does the same for many connections at once, without
    a thread each: :class:`sparkdl.wire.listener.ConnectionListener`).

    Raises:
        ConnectionClosed: the peer closed before sending anything.
        ProtocolError: not a HELLO of ``protocol`` under ``secret``.
    """
    challenge = server_challenge(protocol, encrypt)
    sock.sendall(challenge)
    raw = _recv_exactly(sock, protocol.hello_size, at_frame_start=True)
    return accept_hello(sock, raw, challenge, secret, protocol)


def check_prefix(header: bytes, protocol: WireProtocol) -> None:
    """Refuse a header whose magic, framing version or protocol id is not ``protocol``'s."""
    magic, version, ident, _, _ = PREFIX.unpack_from(header)
    _check_identity(magic, version, ident, protocol)


def _check_identity(magic: bytes, version: int, ident: int, protocol: WireProtocol) -> None:
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


def _send_parts(sock: socket.socket, parts: list[memoryview], flags: int = 0) -> None:
    """Send a frame's parts in one ``sendmsg`` (more only if the kernel takes part)."""
    parts = [p for p in parts if p.nbytes]
    while parts:
        _consume(parts, sock.sendmsg(parts, (), flags))


def _consume(views: list[memoryview], count: int) -> None:
    """Drop the first ``count`` bytes of ``views`` (sent or filled), in place."""
    while views and count >= views[0].nbytes:
        count -= views.pop(0).nbytes
    if views and count:
        views[0] = views[0][count:]


def _recv_exactly(sock: socket.socket, count: int, at_frame_start: bool = False) -> bytearray:
    buffer = bytearray(count)
    _recv_into(sock, [memoryview(buffer)], at_frame_start)
    return buffer


def _recv_into(sock: socket.socket, views: list[memoryview], at_frame_start: bool = False) -> None:
    """Fill ``views`` in order from ``sock``, in one ``recvmsg_into`` when the bytes are there."""
    count = sum(v.nbytes for v in views)
    views = [v for v in views if v.nbytes]
    received = 0
    while views:
        n = sock.recvmsg_into(views)[0] if len(views) > 1 else sock.recv_into(views[0])
        if n == 0:
            if received == 0 and at_frame_start:
                raise ConnectionClosed("the peer closed the connection")
            raise ProtocolError(
                f"connection closed after {received} of the {count} bytes expected next (truncated frame)"
            )
        received += n
        _consume(views, n)
