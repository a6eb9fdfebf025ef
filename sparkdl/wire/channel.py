"""The record layer: one authenticated connection that sends and receives a protocol's frames.

A reader authenticates the header before it trusts its length or fields, so a peer
allocates nothing, and places nothing, before it has proved it holds the secret; a
replayed, reordered or reflected frame, or a piece moved within or between frames, fails
because its nonce differs (:mod:`sparkdl.wire.keys`). With ``encrypt`` the header's
protocol fields (a push's loss, rows and clock, a model's size) travel sealed too: only
the prefix a reader needs to take the frame off the socket (protocol, kind, length) is
plain, and authenticated as the fields' associated data.

A payload travels in pieces of ``STREAM_CHUNK`` bytes, each with its tag: the sender tags
a piece once the kernel holds it and the reader verifies each as it lands, so that neither
side's hashing waits for the whole payload; an empty payload carries no tag. With
``encrypt`` each piece is its own AES-256-GCM message (nonced as a tag is, the header as
associated data), opened into a buffer of the channel's before it is copied where the
caller asked: a forged piece's plaintext never lands there, and no frame meets AES-GCM's
limit of 2**31 bytes per message. A channel is made by the handshake (:mod:`sparkdl.wire.handshake`),
which agrees on the transcript its keys are bound to.
"""

from __future__ import annotations

import math
import select
import socket
import threading
from collections.abc import Sequence
from typing import Any, Generic

from cryptography.exceptions import InvalidTag

from sparkdl.errors import ProtocolError
from sparkdl.wire.keys import ProtocolKeys, tag_nonce
from sparkdl.wire.layout import (
    FIELDS_INDEX,
    HEADER_TAG_INDEX,
    KIND_INDEX,
    LENGTH_INDEX,
    PREFIX,
    STREAM_CHUNK,
    TAG_BYTES,
    M,
    Payload,
    PayloadPlacement,
    WireProtocol,
    check_length,
    check_prefix,
    frame_bytes,
)
from sparkdl.wire.socket_io import ReusedBuffer, recv_exactly, recv_into, send_parts

MAX_POLL_MS = (1 << 31) - 1  # poll()'s longest wait (about 24.8 days)


class Channel(Generic[M]):
    """One authenticated connection: sends and receives one protocol's messages.

    Not thread-safe: one thread (or a lock) per channel.

    Args:
        sock: the connected socket.
        secret: the per-fit secret.
        protocol: the protocol spoken on it.
        transcript: what the handshake agreed (:mod:`sparkdl.wire.handshake`): both nonces,
            its X25519 shared secrets and the hash of its bytes.
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
        keys = ProtocolKeys(secret, protocol)
        self._mac = keys.session(transcript, b"/mac")
        self._cipher = keys.session(transcript, b"/aead") if encrypt else None
        self._send_dir, self._recv_dir = (b"c", b"s") if client else (b"s", b"c")
        self._send_seq = 0
        self._recv_seq = 0
        # Sequence numbers are GCM nonces (encrypted) and tag nonces: one used twice would leak
        # the key stream. Each direction takes them under its own lock, whoever the caller.
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._poller: select.poll | None = None  # pending(): this socket's readiness
        self._sealed = ReusedBuffer()  # encrypted: the ciphertext sent
        self._tag_read = memoryview(bytearray(TAG_BYTES))  # plain: each payload piece's tag, as it arrives
        self._opened = ReusedBuffer()  # encrypted: a piece's ciphertext received
        self._plain = ReusedBuffer()  # encrypted: that piece opened, before it goes to the caller

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
            check_length(payload.nbytes)
            frames.append((self.protocol.pack(kind, fields, payload.nbytes), payload))
        with self._send_lock:  # one sender at a time: its own sequence numbers, its frames whole
            parts: list[memoryview] = []
            total = 0
            for index, (header, payload) in enumerate(frames):
                seq = self._send_seq
                self._send_seq += 1
                parts += self._header(seq, header)
                total += frame_bytes(len(header), payload.nbytes)
                if self._cipher is not None:
                    parts = self._seal(seq, header, payload, parts, last=index + 1 == len(frames))
                elif payload.nbytes <= STREAM_CHUNK:
                    if payload.nbytes:
                        parts += [payload, self._tag(seq, 0, payload)]
                else:  # stream: tag each piece once the kernel holds it, while the reader copies it out
                    for piece, start in enumerate(range(0, payload.nbytes, STREAM_CHUNK)):
                        chunk = payload[start : start + STREAM_CHUNK]
                        send_parts(self.sock, [*parts, chunk])
                        parts = [self._tag(seq, piece, chunk)]  # leaves with what follows
            send_parts(self.sock, parts, flags)
            return total

    def pending(self, timeout_s: float = 0.0) -> bool:
        """Whether bytes from the peer (or its end of the connection) have arrived, waiting
        up to ``timeout_s`` for them (0: never waits, whatever the socket's timeout; at
        most ``MAX_POLL_MS``: a longer wait asks again)."""
        if self._poller is None:  # asked every step: made once
            self._poller = select.poll()
            self._poller.register(self.sock, select.POLLIN)
        return bool(self._poller.poll(math.ceil(min(max(timeout_s, 0.0) * 1000, MAX_POLL_MS))))

    def recv(self, max_payload: int, into: PayloadPlacement | None = None) -> M:
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
        with self._recv_lock:  # one reader at a time: frames read whole, in sequence
            return self._recv(max_payload, into)

    def _recv(self, max_payload: int, into: PayloadPlacement | None) -> M:
        size = self.protocol.header.size
        tagged = recv_exactly(self.sock, size + TAG_BYTES, at_frame_start=True)  # every frame has both
        check_prefix(bytes(tagged[: PREFIX.size]), self.protocol)
        seq = self._recv_seq
        if self._cipher is None:
            header = bytes(tagged[:size])
            self._verify(seq, HEADER_TAG_INDEX, header, memoryview(tagged)[size:])
        else:
            header = self._open_header(seq, tagged)
        values = self.protocol.header.unpack(header)
        kind, length, fields = values[KIND_INDEX], values[LENGTH_INDEX], values[FIELDS_INDEX:]
        check_length(length)
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
        for piece, start in enumerate(range(0, length, STREAM_CHUNK)):  # each verified as it lands
            chunk = view[start : start + STREAM_CHUNK]
            if self._cipher is None:
                recv_into(self.sock, [chunk, self._tag_read])
                self._verify(seq, piece, chunk, self._tag_read)
            else:  # opened aside: a forged piece's plaintext never reaches the caller's memory
                sealed = self._opened.view(chunk.nbytes + TAG_BYTES)
                recv_into(self.sock, [sealed])
                opened = self._plain.view(chunk.nbytes)
                try:
                    self._cipher.decrypt_into(tag_nonce(self._recv_dir, seq, piece), sealed, header, opened)
                except InvalidTag:
                    raise self._refused() from None
                chunk[:] = opened
        self._recv_seq += 1
        return self.protocol.decode(kind, fields, payload)

    def _header(self, seq: int, header: bytes) -> list[memoryview]:
        """Frame ``seq``'s header as sent: plain, the header and its tag; encrypted, the
        prefix (what the reader needs to find the frame: protocol, kind, length) and the
        protocol's fields sealed behind it, the prefix as associated data (its GCM tag
        takes the header tag's place and nonce, under the other key)."""
        if self._cipher is None:
            return [memoryview(header), self._tag(seq, HEADER_TAG_INDEX, header)]
        prefix = header[: PREFIX.size]
        nonce = tag_nonce(self._send_dir, seq, HEADER_TAG_INDEX)
        return [memoryview(prefix), memoryview(self._cipher.encrypt(nonce, header[PREFIX.size :], prefix))]

    def _open_header(self, seq: int, tagged: bytearray) -> bytes:
        """The plain header of an encrypted frame (its prefix, its fields opened)."""
        assert self._cipher is not None
        prefix = bytes(tagged[: PREFIX.size])
        try:
            return prefix + self._cipher.decrypt(
                tag_nonce(self._recv_dir, seq, HEADER_TAG_INDEX), bytes(tagged[PREFIX.size :]), prefix
            )
        except InvalidTag:
            raise self._refused() from None

    def _seal(
        self, seq: int, header: bytes, payload: memoryview, parts: list[memoryview], last: bool
    ) -> list[memoryview]:
        """Encrypt ``payload`` piece by piece (each ``STREAM_CHUNK`` its own AES-GCM message,
        nonced as a tag is, the header as associated data) behind ``parts``; return what is
        left to send. A piece is sent before the buffer is sealed again, unless it is a small
        frame's only piece: then it leaves with the frames behind it (copied if there are any)."""
        assert self._cipher is not None
        for piece, start in enumerate(range(0, payload.nbytes, STREAM_CHUNK)):
            chunk = payload[start : start + STREAM_CHUNK]
            sealed = self._sealed.view(chunk.nbytes + TAG_BYTES)
            self._cipher.encrypt_into(tag_nonce(self._send_dir, seq, piece), chunk, header, sealed)
            if payload.nbytes > STREAM_CHUNK:  # a stream: each piece leaves at once
                send_parts(self.sock, [*parts, sealed])
                parts = []
            else:
                parts.append(sealed if last else memoryview(bytes(sealed)))
        return parts

    def _tag(self, seq: int, index: int, data: Payload) -> memoryview:
        """The GMAC tag of ``data`` sent as frame ``seq``'s header (``HEADER_TAG_INDEX``) or its
        piece ``index``."""
        return memoryview(self._mac.encrypt(tag_nonce(self._send_dir, seq, index), b"", data))

    def _verify(self, seq: int, index: int, data: Payload, tag: memoryview) -> None:
        try:
            self._mac.decrypt(tag_nonce(self._recv_dir, seq, index), tag, data)
        except InvalidTag:
            raise self._refused() from None

    def _refused(self) -> ProtocolError:
        return ProtocolError(
            f"{self.protocol.name} frame failed authentication (wrong secret or protocol, "
            "or a replayed, reordered or reflected frame)"
        )
