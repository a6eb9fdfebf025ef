"""The handshake that opens every framed connection and agrees on its transcript.

The server speaks first: a CHALLENGE with a fresh 16-byte nonce, a fresh (ephemeral)
X25519 public key, its static X25519 public key, and whether the connection is encrypted.
The client answers with a HELLO carrying its own fresh nonce and ephemeral public key,
tagged with HMAC-SHA256 under the hello key over the HELLO and the whole challenge
(:class:`sparkdl.wire.keys.ProtocolKeys`). The session's transcript is both nonces, two
X25519 shared secrets (of the two ephemeral keys, and of the client's ephemeral key with
the server's static key, as in Noise's NKpsk0 pattern) and the hash of the challenge and
the HELLO, so that a HELLO's fields rewritten on the way leave the ends with other keys:

- the fit's secret (the pre-shared key) proves the client: a HELLO without it is refused;
- the server's static key proves the server: its public half travels inside the task (the
  client checks the challenge's against it), its private half never leaves the server's
  process (:class:`ServerKey`), so someone on the path who holds the fit's secret (read
  from a task Spark sent in the clear) can open a connection of their own as a worker, but
  can neither read nor rewrite a worker's session: its keys hang on a shared secret they
  cannot compute;
- the ephemeral keys give forward secrecy: they never leave memory and die with the
  handshake, so a recorded session cannot be decrypted later, even by someone who learns
  the fit's secret and the server's static key;
- both nonces make a recorded HELLO, or any frame after it, verify on no other connection.

Each side then holds a :class:`~sparkdl.wire.channel.Channel` keyed by that transcript; the
client learns that the server completed the exchange from the server's first frame, which
verifies only under those keys.

A HELLO's header fields may name the resource it asks for (a lookup then chooses the
secret), but they are trusted only once its tag verified under that secret.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from sparkdl.errors import ConnectionClosed, ProtocolError, ServerBusy
from sparkdl.wire.channel import Channel
from sparkdl.wire.keys import ProtocolKeys
from sparkdl.wire.layout import (
    CHALLENGE,
    ENCRYPTED,
    FIELDS_INDEX,
    HELLO_PAYLOAD_BYTES,
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

log = logging.getLogger(__name__)
T = TypeVar("T")


class ServerKey:
    """A server's static X25519 key: made in memory when the server starts, never written
    or sent; only :attr:`public` leaves the process (inside the tasks, which check the
    server's challenge against it)."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public = _public(self._private)

    def exchange(self, peer_public: bytes, protocol: WireProtocol) -> bytes:
        return _shared(self._private, peer_public, protocol)

    def __repr__(self) -> str:  # never print the private half
        return f"ServerKey({self.public.hex()[:16]}...)"


@dataclass(frozen=True)
class Challenge:
    """A server's CHALLENGE as sent, the private half of its ephemeral key (kept only
    until the HELLO is verified) and the server's static key."""

    data: bytes
    ephemeral: X25519PrivateKey
    key: ServerKey


def server_challenge(protocol: WireProtocol, key: ServerKey, encrypt: bool = False) -> Challenge:
    """The CHALLENGE a server sends first on a new connection: a fresh nonce, a fresh
    ephemeral key, the server's static public key, and whether the connection is encrypted."""
    ephemeral = X25519PrivateKey.generate()
    data = CHALLENGE.pack(
        MAGIC,
        VERSION,
        protocol.ident,
        ENCRYPTED if encrypt else 0,
        os.urandom(NONCE_BYTES),
        _public(ephemeral),
        key.public,
    )
    return Challenge(data, ephemeral, key)


def _public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _shared(own: X25519PrivateKey, peer_public: bytes, protocol: WireProtocol) -> bytes:
    """The X25519 shared secret with the peer's public key (a key of low order, which would
    make it all zeros, is refused)."""
    try:
        return own.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:
        raise ProtocolError(f"{protocol.name} handshake: the peer's public key is unusable ({exc})") from None


def client_hello(
    sock: socket.socket,
    secret: bytes,
    protocol: WireProtocol[M],
    hello: M,
    encrypt: bool = False,
    *,
    server_key: bytes,
) -> Channel[M]:
    """Read the server's challenge and answer with ``hello`` (a message of the protocol's
    HELLO kind); the caller then reads the protocol's answer on the returned channel (the
    first frame that verifies proves the server holds ``server_key``'s private half).

    Args:
        server_key: the server's static public key, as the task was given it.

    Raises:
        ProtocolError: the server closed before its challenge (it refused the connection),
            is not a sparkdl server of ``protocol``, is not the server this task was
            given (another static key), or disagrees about encryption.
    """
    kind, fields, payload = protocol.encode(hello)
    if kind != protocol.hello_kind or len(payload):
        raise ValueError(f"a {protocol.name} connection opens with a HELLO without payload, not kind {kind}")
    try:
        challenge = bytes(recv_exactly(sock, CHALLENGE.size, at_frame_start=True))
    except ConnectionClosed:
        raise ConnectionClosed(
            f"the {protocol.name} server closed the connection before its challenge: it refused it "
            "(over its connection cap, or shutting down)"
        ) from None
    magic, version, ident, flags, server_nonce, server_public, static = CHALLENGE.unpack(challenge)
    check_identity(magic, version, ident, protocol)
    if static != server_key:
        raise ProtocolError(
            f"the {protocol.name} server at {_address(sock)} is not the one this task was given: its "
            f"static key {static.hex()[:16]}... differs from the task's {server_key.hex()[:16]}... "
            "(a server started since on the same port, or another process posing as the driver)"
        )
    if bool(flags & ENCRYPTED) != encrypt:
        raise ProtocolError(
            f"the {protocol.name} server {'encrypts' if flags & ENCRYPTED else 'does not encrypt'} "
            f"but this worker was told {'to' if encrypt else 'not to'}: the driver and the executors "
            "disagree about runtime.encrypt"
        )
    ephemeral = X25519PrivateKey.generate()
    shared = _shared(ephemeral, server_public, protocol) + _shared(ephemeral, static, protocol)
    offer = os.urandom(NONCE_BYTES) + _public(ephemeral)  # the HELLO's payload: nonce, public key
    header = protocol.pack(kind, fields, HELLO_PAYLOAD_BYTES)
    sock.sendall(header + offer + ProtocolKeys(secret, protocol).hello_tag(header + offer, challenge))
    transcript = offer[:NONCE_BYTES] + server_nonce + shared + _said(challenge, header + offer)
    return Channel(sock, secret, protocol, transcript, client=True, encrypt=encrypt)


def _said(challenge: bytes, hello: bytes) -> bytes:
    """The hash of the handshake's every byte (the challenge, the HELLO's header and offer),
    which the session's keys hang on: a HELLO whose fields someone holding the secret
    rewrote on the way (and tagged again) leaves the two ends with different keys, so the
    session fails at its first frame, as Noise's handshake hash does."""
    return hashlib.sha256(challenge + hello).digest()


def _address(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "(disconnected)"


#: How long a client retries a handshake the server closed before answering it (a flood of
#: connections evicted it, or the server was at its cap), and its first and longest waits:
#: three of a listener's HELLO timeouts (5 s), so that a flood whose connections are renewed
#: as they expire cannot keep a client's every try in one unlucky phase; each wait is
#: jittered (x0.5 to x1.5), so that clients turned away together do not return together.
HANDSHAKE_RETRY_S = 15.0
_RETRY_FIRST_S, _RETRY_MOST_S = 0.05, 1.0


def with_retries(open_: Callable[[], T], what: str, deadline_s: float = HANDSHAKE_RETRY_S) -> T:
    """``open_()`` (connect, HELLO, and the server's first answer), tried again, with a
    jittered backoff doubling from 50 ms to 1 s, while the server turns the handshake away (it says
    :data:`~sparkdl.wire.socket_io.BUSY`: its pending handshakes were full, a flood at its
    port) or resets it, for at most ``deadline_s``: a later try gets in. A HELLO the server
    refused (a wrong secret) is closed without a word and fails at once.

    Raises:
        ServerBusy, OSError: the last try's error, once the deadline is past.
    """
    deadline = time.monotonic() + deadline_s
    wait = _RETRY_FIRST_S
    tries = 1
    while True:
        try:
            return open_()
        except (ServerBusy, ConnectionResetError, BrokenPipeError) as exc:
            if time.monotonic() + wait > deadline:
                raise type(exc)(
                    f"{exc} ({what}: {tries} handshakes closed by the server in {deadline_s:g} s)"
                ) from exc
            log.info(
                "%s: the server closed handshake %d before answering (%s); again in %.2f s",
                what,
                tries,
                exc,
                wait,
            )
            time.sleep(wait * random.uniform(0.5, 1.5))
            wait, tries = min(2 * wait, _RETRY_MOST_S), tries + 1


def accept_hello(
    sock: socket.socket,
    raw: bytes | bytearray,
    challenge: Challenge,
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
    header, offer, tag = raw[:size], raw[size : size + HELLO_PAYLOAD_BYTES], raw[size + HELLO_PAYLOAD_BYTES :]
    check_prefix(header, protocol)
    values = protocol.header.unpack(header)
    if values[KIND_INDEX] != protocol.hello_kind or values[LENGTH_INDEX] != HELLO_PAYLOAD_BYTES:
        raise ProtocolError(f"first {protocol.name} frame was of kind {values[KIND_INDEX]}, expected a HELLO")
    key = secret if isinstance(secret, bytes) else secret(values[FIELDS_INDEX:])
    if key is None or not hmac.compare_digest(
        tag, ProtocolKeys(key, protocol).hello_tag(header + offer, challenge.data)
    ):
        raise ProtocolError(
            f"{protocol.name} HELLO failed authentication (wrong or missing job secret, or a replayed HELLO)"
        )
    hello = protocol.decode(values[KIND_INDEX], values[FIELDS_INDEX:], bytearray())
    _, _, _, flags, server_nonce, _, _ = CHALLENGE.unpack(challenge.data)
    client_public = offer[NONCE_BYTES:]  # the exchanges only once authenticated
    shared = _shared(challenge.ephemeral, client_public, protocol) + challenge.key.exchange(
        client_public, protocol
    )
    transcript = offer[:NONCE_BYTES] + server_nonce + shared + _said(challenge.data, header + offer)
    return hello, Channel(sock, key, protocol, transcript, client=False, encrypt=bool(flags & ENCRYPTED))


def server_hello(
    sock: socket.socket,
    secret: bytes | SecretLookup,
    protocol: WireProtocol[M],
    key: ServerKey,
    encrypt: bool = False,
) -> tuple[M, Channel[M]]:
    """The server's side of a handshake on one blocking socket: send a challenge, read and
    verify the HELLO (the listener does the same for many connections at once, without
    a thread each: :class:`sparkdl.wire.listener.ConnectionListener`).

    Raises:
        ConnectionClosed: the peer closed before sending anything.
        ProtocolError: not a HELLO of ``protocol`` under ``secret``.
    """
    challenge = server_challenge(protocol, key, encrypt)
    sock.sendall(challenge.data)
    raw = recv_exactly(sock, protocol.hello_size, at_frame_start=True)
    return accept_hello(sock, raw, challenge, secret, protocol)
