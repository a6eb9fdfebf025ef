"""Wire protocol of the parameter server: a fixed header, raw tensor bytes, an HMAC tag.

    frame = header (HEADER.size bytes) || payload (header.length bytes) || tag (32 bytes)
    tag   = HMAC-SHA256(job secret, header || payload)

No pickle, no JSON: the payload is the raw little-endian float32 bytes of one shard.
A reader looks only at the magic and the length (to know how much to read, capped at
``max_payload``) before it checks the tag with a constant-time compare; nothing else
of a frame is interpreted until the tag is verified.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import socket
import struct
from dataclasses import dataclass

from sparkdl.errors import SparkDLError

Payload = bytes | bytearray | memoryview

MAGIC = b"SDPS"
VERSION = 1
TAG_BYTES = 32
# magic, version, kind, dtype, shard, rank, attempt, clock, rows, length
HEADER = struct.Struct("<4sBBBxHxxIIQQQ")
FLOAT32 = 1


class Kind(enum.IntEnum):
    HELLO = 1  # worker -> server: rank and stage attempt; answered by ACK
    PUSH = 2  # worker -> server: rows-weighted gradient sum of one shard at a clock
    PULL = 3  # worker -> server: weights of one shard for a clock; answered by WEIGHTS
    WEIGHTS = 4  # server -> worker: the shard's weights; ``clock`` holds their version
    ACK = 5
    ERROR = 6  # server -> worker: payload is a UTF-8 reason


class ProtocolError(SparkDLError):
    """A frame was malformed, unauthenticated, too large, or out of order."""


@dataclass(frozen=True)
class Frame:
    kind: Kind
    shard: int = 0
    rank: int = 0
    attempt: int = 0
    clock: int = 0
    rows: int = 0
    payload: Payload = b""
    dtype: int = FLOAT32


def _tag(secret: bytes, header: bytes, payload: Payload) -> bytes:
    mac = hmac.new(secret, header, hashlib.sha256)
    mac.update(payload)  # no header + payload concatenation: payloads can be 100s of MB
    return mac.digest()


def encode(frame: Frame, secret: bytes) -> tuple[bytes, memoryview, bytes]:
    """Serialize and sign a frame: (header, payload, tag), sent back to back."""
    payload = memoryview(frame.payload).cast("B")
    header = HEADER.pack(
        MAGIC,
        VERSION,
        int(frame.kind),
        frame.dtype,
        frame.shard,
        frame.rank,
        frame.attempt,
        frame.clock,
        frame.rows,
        payload.nbytes,
    )
    return header, payload, _tag(secret, header, payload)


def send_frame(sock: socket.socket, frame: Frame, secret: bytes) -> int:
    """Send one frame without copying its payload; return the bytes sent."""
    header, payload, tag = encode(frame, secret)
    sock.sendall(header)
    sock.sendall(payload)
    sock.sendall(tag)
    return len(header) + payload.nbytes + len(tag)


def recv_frame(sock: socket.socket, secret: bytes, max_payload: int) -> Frame:
    """Read, authenticate and decode one frame.

    Raises:
        ProtocolError: bad magic, a length over ``max_payload``, a closed or truncated
            stream, or a tag that does not verify.
    """
    header = _recv_exactly(sock, HEADER.size)
    magic, version, kind, dtype, shard, rank, attempt, clock, rows, length = HEADER.unpack(bytes(header))
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a sparkdl parameter-server client")
    if length > max_payload:
        raise ProtocolError(
            f"frame announces {length} payload bytes, over the cap of {max_payload}; "
            "raise ps_max_frame_mb if the model's largest shard is bigger"
        )
    payload = _recv_exactly(sock, length)
    tag = _recv_exactly(sock, TAG_BYTES)
    if not hmac.compare_digest(bytes(tag), _tag(secret, bytes(header), payload)):
        raise ProtocolError("frame failed authentication (wrong or missing job secret)")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, expected {VERSION}")
    try:
        kind_enum = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    return Frame(kind_enum, shard, rank, attempt, clock, rows, payload, dtype)


def _recv_exactly(sock: socket.socket, count: int) -> bytearray:
    buffer = bytearray(count)
    view = memoryview(buffer)
    received = 0
    while received < count:
        n = sock.recv_into(view[received:], count - received)
        if n == 0:
            raise ProtocolError(f"connection closed after {received} of {count} bytes (truncated frame)")
        received += n
    return buffer
