"""The handshake that opens every framed connection and agrees on its transcript.

The server speaks first: a CHALLENGE with a fresh 16-byte nonce, and whether the
connection is encrypted. The client answers with a HELLO carrying its own fresh nonce,
tagged with HMAC-SHA256 under the hello key over the HELLO and the whole challenge
(:class:`sparkdl.wire.keys.ProtocolKeys`). The session's transcript is both nonces, so a
recorded HELLO, or any frame after it, verifies on no other connection: the server's
nonce differs. Each side then holds a :class:`~sparkdl.wire.channel.Channel` keyed by
that transcript.

A HELLO's header fields may name the resource it asks for (a lookup then chooses the
secret), but they are trusted only once its tag verified under that secret.
"""

from __future__ import annotations

import hmac
import os
import socket

from sparkdl.errors import ConnectionClosed, ProtocolError
from sparkdl.wire.channel import Channel
from sparkdl.wire.keys import ProtocolKeys
from sparkdl.wire.layout import (
    CHALLENGE,
    ENCRYPTED,
    FIELDS_INDEX,
    KIND_INDEX,
    LENGTH_INDEX,
    MAGIC,
    NONCE_BYTES,
    VERSION,
    M,
    SecretLookup,
    WireProtocol,
    check_identity,
    check_prefix,
)
from sparkdl.wire.socket_io import recv_exactly


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
        challenge = bytes(recv_exactly(sock, CHALLENGE.size, at_frame_start=True))
    except ConnectionClosed:
        raise ProtocolError(
            f"the {protocol.name} server closed the connection before its challenge: it refused it "
            "(over its connection cap, or shutting down)"
        ) from None
    magic, version, ident, flags, server_nonce = CHALLENGE.unpack(challenge)
    check_identity(magic, version, ident, protocol)
    if bool(flags & ENCRYPTED) != encrypt:
        raise ProtocolError(
            f"the {protocol.name} server {'encrypts' if flags & ENCRYPTED else 'does not encrypt'} "
            f"but this worker was told {'to' if encrypt else 'not to'}: the driver and the executors "
            "disagree about runtime.encrypt"
        )
    nonce = os.urandom(NONCE_BYTES)
    header = protocol.pack(kind, fields, NONCE_BYTES)
    sock.sendall(header + nonce + ProtocolKeys(secret, protocol).hello_tag(header + nonce, challenge))
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
    if values[KIND_INDEX] != protocol.hello_kind or values[LENGTH_INDEX] != NONCE_BYTES:
        raise ProtocolError(f"first {protocol.name} frame was of kind {values[KIND_INDEX]}, expected a HELLO")
    key = secret if isinstance(secret, bytes) else secret(values[FIELDS_INDEX:])
    if key is None or not hmac.compare_digest(
        tag, ProtocolKeys(key, protocol).hello_tag(header + nonce, challenge)
    ):
        raise ProtocolError(
            f"{protocol.name} HELLO failed authentication (wrong or missing job secret, or a replayed HELLO)"
        )
    hello = protocol.decode(values[KIND_INDEX], values[FIELDS_INDEX:], bytearray())
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
    raw = recv_exactly(sock, protocol.hello_size, at_frame_start=True)
    return accept_hello(sock, raw, challenge, secret, protocol)
