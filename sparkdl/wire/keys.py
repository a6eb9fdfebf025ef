"""The framing's keys and nonces: what every tag and ciphertext of a connection is bound to.

Keys are derived from the per-fit secret and the protocol's name
(``HMAC-SHA256(secret, "sparkdl-net/<version>/<name>/hello")``, ``.../frame`` likewise),
so a frame of one protocol never verifies as another's. A HELLO is tagged with
HMAC-SHA256 under the hello key. A connection's frames are tagged with GMAC (AES-256-GCM
over an empty plaintext, the tagged bytes as associated data) under a per-connection key,
``HMAC-SHA256(frame key, transcript | "/mac")``; with ``encrypt`` its payloads are
AES-256-GCM ciphertext under a second one, ``HMAC-SHA256(frame key, transcript | "/aead")``.
The transcript is both nonces of the handshake, its X25519 shared secrets (ephemeral with
ephemeral, the client's ephemeral with the server's static key) and the hash of its bytes,
so nothing recorded on one connection verifies on another, and the fit's secret alone
(learnt later, say from a task Spark sent in the clear) opens no recorded session: its
keys also hang on ephemeral private keys that were never sent or stored.

Every tag has a nonce of its own: direction, sequence number and what it tags (the
header, or a piece of the payload by its index); an encrypted payload's pieces take the
same nonces as plain pieces' tags, under the other key. A replayed, reordered or
reflected frame, or a piece moved within or between frames, therefore fails because its
nonce differs.

Why GMAC: it runs at about 20 GB/s here (carry-less multiplication), Poly1305 at 12 GB/s
and HMAC at 1 GB/s, and a small tag takes 0.55 us against Poly1305's 2.5; one key per
connection spares each frame the derivation of one-time keys (1.7 us). Header-only round
trips: +45 us over a bare socket against +104-119 us with version 4's Poly1305
(``benchmarks/bench_framing.py``).

Kept in a module of its own because both the handshake (the HELLO's tag) and the channel
(the session keys, the nonces) derive from it, and neither should reach into the other.
"""

from __future__ import annotations

import hashlib
import hmac

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from sparkdl.wire.layout import WireProtocol


class ProtocolKeys:
    """The keys of one protocol under one secret: the HELLO's, and the root of a session's keys."""

    def __init__(self, secret: bytes, protocol: WireProtocol) -> None:
        self.hello = hmac.new(secret, protocol.domain + b"/hello", hashlib.sha256).digest()
        self._root = hmac.new(secret, protocol.domain + b"/frame", hashlib.sha256).digest()

    def hello_tag(self, hello: bytes, challenge: bytes) -> bytes:
        """The HMAC-SHA256 tag of a HELLO over the HELLO and the whole challenge it answers."""
        return hmac.new(self.hello, hello + challenge, hashlib.sha256).digest()

    def session(self, transcript: bytes, purpose: bytes) -> AESGCM:
        """A session's AES-256-GCM key for ``purpose`` (``/mac``: the tags, ``/aead``: the
        encrypted payloads), its own per connection."""
        return AESGCM(hmac.new(self._root, transcript + purpose, hashlib.sha256).digest())


def tag_nonce(direction: bytes, seq: int, index: int) -> bytes:
    """A tag's nonce: unique per connection key while ``seq`` < 2**56 (past it, to_bytes
    raises) and a piece's index stays under ``HEADER_TAG_INDEX``
    (:func:`sparkdl.wire.layout.check_length`)."""
    return direction + seq.to_bytes(7, "little") + index.to_bytes(4, "little")
