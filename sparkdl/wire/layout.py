"""The layout of the framing's bytes: the header, the challenge, the sizes of nonces and
tags, and the :class:`WireProtocol` that each protocol fills in.

    challenge = magic, framing version, protocol id, flags, server nonce,
                ephemeral public key, static public key                      (server -> client)
    hello     = header (kind HELLO, length 48) || client nonce || client's ephemeral public key
                || HMAC tag                                                  (client -> server)
    frame     = header || header tag || payload pieces, each followed by its tag   (plain)
              | prefix || sealed fields || their AEAD tag
                || payload pieces' ciphertext, each followed by its AEAD tag     (encrypted)
    header    = magic, framing version, protocol id, kind, payload length (PREFIX, 16 bytes)
                || the protocol's own fields (one fixed struct per protocol)

Kept apart from the keys, the handshake and the channel because all of them read it: it
says what the bytes are, not how they are authenticated or sent. The checks here (a
prefix of another protocol or version, a length the nonces cannot cover) refuse a frame
by its layout alone; the channel and the handshake call them at the points where their
order matters (a header's fields are trusted only once its tag verified).
"""

from __future__ import annotations

import abc
import enum
import functools
import struct
from collections.abc import Callable
from typing import Generic, TypeVar

from sparkdl.errors import ProtocolError

Payload = bytes | bytearray | memoryview
Fields = tuple[int, ...]
M = TypeVar("M")
E = TypeVar("E", bound=enum.IntEnum)

#: Where a frame's payload is read to, by (kind, header fields, length): a writable view of
#: exactly ``length`` bytes, or None for a fresh buffer. Called once the header verified.
PayloadPlacement = Callable[[int, Fields, int], "memoryview | None"]

#: The secret a HELLO must verify under, chosen by its (not yet authenticated) header fields;
#: None refuses the connection. Lets one server hold a secret per resource it serves.
SecretLookup = Callable[[Fields], "bytes | None"]

MAGIC = b"SDNT"
#: 8: the server's static key in the handshake, an encrypted connection's header fields sealed;
#: 7: an X25519 key exchange in the handshake; 6: encrypted payloads in pieces
VERSION = 8
PREFIX = struct.Struct("<4sBBBxQ")  # magic, version, protocol id, kind, (pad), payload length
# magic, version, protocol id, flags, (pad), server nonce, the server's ephemeral and static
# X25519 public keys
CHALLENGE = struct.Struct("<4sBBBx16s32s32s")
ENCRYPTED = 1  # the challenge's flag: every payload of the connection is encrypted
NONCE_BYTES = 16
KEY_BYTES = 32  # an X25519 public key
HELLO_PAYLOAD_BYTES = NONCE_BYTES + KEY_BYTES  # a HELLO's payload: the client's nonce and public key
HELLO_TAG_BYTES = 32  # HMAC-SHA256
TAG_BYTES = 16  # a GMAC tag, or the AES-GCM one
KIND_INDEX = 3  # index of the kind in an unpacked header
LENGTH_INDEX = 4  # index of the payload length
FIELDS_INDEX = 5  # the protocol's fields start here
#: A plaintext payload is tagged in pieces of this size; a larger one is sent piece by piece,
#: each tagged once the kernel holds it, so the sender's hashing overlaps the reader's
#: copying and hashing. Part of the wire format: a change needs a new ``VERSION``. 1 MiB:
#: a 4 MB echo (bench_framing.py) reached 0.55-0.64 of a bare socket's round trips in
#: pieces of 1, 2 or 4 MiB, 0.45-0.50 in pieces of 256 KiB (a syscall and a tag per piece).
STREAM_CHUNK = 1 << 20
HEADER_TAG_INDEX = 0xFFFFFFFF  # the nonce's index of a header's tag (a payload piece's is its index)
MAX_FRAME_PAYLOAD = HEADER_TAG_INDEX * STREAM_CHUNK  # pieces 0 .. HEADER_TAG_INDEX - 1 (about 4 PiB)


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
        """The bytes of a HELLO: header, client nonce and public key, tag (the same for every HELLO)."""
        return self.header.size + HELLO_PAYLOAD_BYTES + HELLO_TAG_BYTES

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


def frame_bytes(header_bytes: int, payload_bytes: int) -> int:
    """The bytes a frame takes on the wire: header, its tag, payload and the payload's tags
    (one per ``STREAM_CHUNK`` piece, plain or encrypted; none for an empty payload)."""
    tags = -(-payload_bytes // STREAM_CHUNK)
    return header_bytes + TAG_BYTES + payload_bytes + tags * TAG_BYTES


def check_length(length: int) -> None:
    """Refuse a payload with a piece whose index would be the header's (about 4 PiB): its
    tag's nonce would repeat the header's."""
    if length > MAX_FRAME_PAYLOAD:
        raise ProtocolError(
            f"a frame of {length} payload bytes: the framing carries at most {MAX_FRAME_PAYLOAD}"
        )


def check_prefix(header: bytes, protocol: WireProtocol) -> None:
    """Refuse a header whose magic, framing version or protocol id is not ``protocol``'s."""
    magic, version, ident, _, _ = PREFIX.unpack_from(header)
    check_identity(magic, version, ident, protocol)


def check_identity(magic: bytes, version: int, ident: int, protocol: WireProtocol) -> None:
    """Refuse a prefix or challenge whose magic, framing version or protocol id is not
    ``protocol``'s (checked in that order)."""
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
