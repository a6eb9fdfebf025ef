"""The wire under the driver's servers: the listener, the authenticated framing, the
parameter server's typed errors, and the progress channel's heartbeats. Real sockets,
loopback only; every wait is bounded."""

from __future__ import annotations

import enum
import hashlib
import itertools
import logging
import socket
import struct
import threading
import time

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

import sparkdl.wire.layout as wire_layout
import sparkdl.wire.listener as listener_module
from sparkdl.errors import (
    CheckpointError,
    ConfigError,
    ConnectionClosed,
    ParameterServerError,
    PeerStopped,
    ProtocolError,
    PsAborted,
    PsTimeoutError,
    PushRejected,
)
from sparkdl.services.progress.board import ProgressBoard
from sparkdl.services.progress.channel import (
    ProgressEndpoint,
    ProgressReporter,
    ProgressServer,
    reporting_to_driver,
)
from sparkdl.services.progress.protocol import MAX_PAYLOAD, PROGRESS_WIRE, Ack, Goodbye, Heartbeat, Hello, Log
from sparkdl.services.ps.protocol import PS_WIRE, ErrorCode, Frame, Kind, error_frame, error_of
from sparkdl.wire.framing import (
    PREFIX,
    STREAM_CHUNK,
    TAG_BYTES,
    Channel,
    ServerKey,
    WireProtocol,
    accept_hello,
    client_hello,
    frame_bytes,
    member,
    server_challenge,
)
from sparkdl.wire.layout import NONCE_BYTES
from sparkdl.wire.listener import ConnectionListener

SECRET = b"s" * 32
KEY = ServerKey()  # the static key of the servers these tests play by hand
NONCE = b"n" * 16
log = logging.getLogger("test-net")


def wait_until(condition, timeout=5.0):
    """Poll ``condition`` until it holds or ``timeout`` seconds pass; return whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


class EchoKind(enum.IntEnum):
    HELLO = 1
    DATA = 2


class Echo(WireProtocol[tuple[int, tuple[int, ...], bytes]]):
    """A test protocol: header fields (a: uint32, b: uint64), messages as plain tuples."""

    def encode(self, message):
        return message

    def decode(self, kind, fields, payload):
        return member(EchoKind, kind, self.name), fields, bytes(payload)


ECHO = Echo("test-echo", ident=9, fields="IQ", hello_kind=EchoKind.HELLO)


def pair(protocol=ECHO, client_protocol=None, encrypt=False):
    """Two connected sockets and a client and server channel on them (no HELLO)."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    client = Channel(a, SECRET, client_protocol or protocol, NONCE, client=True, encrypt=encrypt)
    server = Channel(b, SECRET, protocol, NONCE, client=False, encrypt=encrypt)
    return a, b, client, server


def sent_bytes(protocol, messages, client=True):
    """The bytes a fresh channel sends for ``messages``, one ``bytes`` per frame."""
    x, y = socket.socketpair()
    with x, y:
        channel = Channel(x, SECRET, protocol, NONCE, client=client)
        sizes = [channel.send(m) for m in messages]
        y.settimeout(5)
        data = b""
        while len(data) < sum(sizes):
            data += y.recv(65536)
    frames, offset = [], 0
    for size in sizes:
        frames.append(data[offset : offset + size])
        offset += size
    return frames


# --- the listener ---------------------------------------------------------------------


def listen(serve, name, **options):
    """A listener of the echo protocol under SECRET."""
    return ConnectionListener("127.0.0.1", ECHO, SECRET, serve, name, log, **options)


def connect(listener, secret=SECRET, timeout=5):
    """A client channel to ``listener`` after its handshake."""
    sock = socket.create_connection((listener.host, listener.port), timeout=timeout)
    return client_hello(sock, secret, ECHO, (EchoKind.HELLO, (1, 2), b""), server_key=listener.public_key)


def test_the_listener_serves_each_authenticated_connection_on_its_own_thread():
    release = threading.Event()
    served: list[tuple[str, object]] = []

    def serve(hello, channel, peer):
        served.append((threading.current_thread().name, hello))
        channel.send((EchoKind.DATA, (0, 0), b"hi"))
        release.wait(5)

    listener = listen(serve, "test-net")
    clients = [connect(listener) for _ in range(3)]
    try:
        assert [c.recv(16)[2] for c in clients] == [b"hi"] * 3  # all three served at once
        assert len({name for name, _ in served}) == 3
        assert all(name.startswith("test-net-") for name, _ in served)
        assert all(hello == (EchoKind.HELLO, (1, 2), b"") for _, hello in served)
    finally:
        release.set()
        listener.stop(timeout=5)
        for c in clients:
            c.sock.close()
    assert not any(t.name.startswith("test-net") and t.is_alive() for t in threading.enumerate())
    assert listener.sessions == 0


def test_stop_closes_open_connections_and_the_port_in_bounded_time():
    def serve(hello, channel, peer):
        try:
            channel.sock.recv(10)  # blocks until stop() closes the socket
        except OSError:
            pass

    listener = listen(serve, "test-net-idle")
    client = connect(listener)
    with client.sock:
        assert wait_until(lambda: listener.sessions == 1)
        started = time.monotonic()
        listener.stop(timeout=5)
        assert time.monotonic() - started < 3
        assert client.sock.recv(10) == b""  # the server closed our connection
    with pytest.raises(OSError):
        socket.create_connection((listener.host, listener.port), timeout=2).close()
    assert not any(t.name.startswith("test-net-idle") and t.is_alive() for t in threading.enumerate())


def test_stop_wakes_the_handshake_loop_rather_than_wait_for_its_next_poll(monkeypatch):
    # every fit stops three listeners (progress, weights, parameter server) on its way out
    monkeypatch.setattr(listener_module, "_POLL_S", 60.0)
    listener = listen(lambda hello, channel, peer: None, "test-net-wake")
    assert wait_until(lambda: listener._loop.is_alive())
    listener.stop(timeout=5)  # with the poll alone, the loop would have gone on for a minute
    assert not listener._loop.is_alive()
    listener.stop(timeout=5)  # a second stop is harmless


def test_stop_is_bounded_even_when_a_connection_ignores_the_close():
    release = threading.Event()
    listener = listen(lambda hello, channel, peer: release.wait(10), "test-net-stuck")
    with connect(listener).sock:
        assert wait_until(lambda: listener.sessions == 1)
        started = time.monotonic()
        listener.stop(timeout=0.3)
        assert time.monotonic() - started < 2
    release.set()


@pytest.mark.parametrize("drain_s, finished", [(3.0, True), (0.0, False)])
def test_drain_lets_a_connection_read_what_its_peer_sent_before_it_is_closed(drain_s, finished):
    received: list[bytes | None] = []

    def serve(hello, channel, peer):
        time.sleep(0.3)  # a slow reader: the peer is done long before
        try:
            data = b""
            while chunk := channel.sock.recv(65536):
                data += chunk
            received.append(data)
        except OSError:
            received.append(None)  # closed by stop() before it was done

    listener = listen(serve, "test-net-drain")
    client = connect(listener)
    with client.sock:
        client.sock.sendall(b"x" * 100_000)
        client.sock.shutdown(socket.SHUT_WR)
        assert wait_until(lambda: listener.sessions == 1)
        listener.stop(timeout=5, drain_s=drain_s)
    assert wait_until(lambda: received)
    assert (received == [b"x" * 100_000]) is finished


# --- the framing ----------------------------------------------------------------------


def test_frames_round_trip_with_their_kind_fields_and_payload():
    a, b, client, server = pair()
    with a, b:
        weights = np.arange(4, dtype=np.float32)
        sent = client.send((EchoKind.DATA, (7, 2**40), weights.data))
        assert sent == ECHO.header.size + TAG_BYTES + 16 + TAG_BYTES  # header, its tag, 4 floats, tag
        assert server.recv(1024) == (EchoKind.DATA, (7, 2**40), weights.tobytes())
        server.send((EchoKind.DATA, (1, 2), b""))  # the other direction, empty payload
        assert client.recv(1024) == (EchoKind.DATA, (1, 2), b"")


def test_a_parameter_server_frame_keeps_every_named_field():
    a, b, client, server = pair(PS_WIRE)
    with a, b:
        payload = np.arange(4, dtype=np.float32).data
        frame = Frame(Kind.PUSH, 1, 2, 3, 4, 5, payload, version=6, staleness=7, area=8, area_bytes=9)
        client.send(frame)
        got = server.recv(1024)
        fields = (
            got.kind,
            got.shard,
            got.rank,
            got.attempt,
            got.clock,
            got.rows,
            got.version,
            got.staleness,
            got.area,
            got.area_bytes,
        )
        assert fields == (Kind.PUSH, 1, 2, 3, 4, 5, 6, 7, 8, 9) and got.error is ErrorCode.NONE
        assert struct.unpack("<4f", got.payload) == (0.0, 1.0, 2.0, 3.0)


@pytest.mark.parametrize("where", ["header", "header tag", "payload", "tag"])
def test_a_flipped_bit_anywhere_fails_authentication(where):
    (frame,) = sent_bytes(ECHO, [(EchoKind.DATA, (7, 8), b"p" * 32)])
    size = ECHO.header.size
    index = {
        "header": size - 3,
        "header tag": size + 2,
        "payload": size + TAG_BYTES + 5,
        "tag": len(frame) - 1,
    }[where]
    a, b, _, server = pair()
    with a, b:
        a.sendall(frame[:index] + bytes([frame[index] ^ 1]) + frame[index + 1 :])
        with pytest.raises(ProtocolError, match="authentication"):
            server.recv(1024)


def _large_frame_bytes(payload):
    """The bytes a client channel sends for one frame too large for one socket buffer."""
    x, y = socket.socketpair()
    with x, y:
        y.settimeout(5)
        channel = Channel(x, SECRET, ECHO, NONCE, client=True)
        sender = threading.Thread(target=channel.send, args=((EchoKind.DATA, (7, 8), payload),))
        sender.start()
        size = frame_bytes(ECHO.header.size, len(payload))
        data = bytearray()
        while len(data) < size:
            data += y.recv(1 << 20)
        sender.join(5)
    return bytes(data)


PIECE = STREAM_CHUNK + TAG_BYTES  # a full payload piece on the wire, with its tag


def feeding(sock, data):
    """A started thread that writes ``data`` to ``sock`` until the reader closes its end."""

    def feed():
        try:
            sock.sendall(data)
        except OSError:
            pass  # the reader refused the frame part way and closed its end

    thread = threading.Thread(target=feed)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "flip", [None, "first piece", "first piece's tag", "middle piece", "last byte", "last tag"]
)
def test_a_payload_streamed_in_pieces_round_trips_and_any_flipped_bit_fails(flip):
    payload = np.random.default_rng(0).integers(0, 256, 3 * STREAM_CHUNK + 5, dtype=np.uint8).tobytes()
    frame = bytearray(_large_frame_bytes(payload))
    start = ECHO.header.size + TAG_BYTES
    assert len(frame) == start + 3 * PIECE + 5 + TAG_BYTES  # four pieces, each tagged
    if flip is not None:
        index = {
            "first piece": start + 10,
            "first piece's tag": start + STREAM_CHUNK + 3,
            "middle piece": start + PIECE + STREAM_CHUNK // 2,
            "last byte": len(frame) - TAG_BYTES - 1,
            "last tag": len(frame) - 1,
        }[flip]
        frame[index] ^= 1
    a, b, _, server = pair()
    with a, b:
        feeder = feeding(a, bytes(frame))
        if flip is None:
            assert server.recv(len(payload)) == (EchoKind.DATA, (7, 8), payload)
        else:
            with pytest.raises(ProtocolError, match="authentication"):
                server.recv(len(payload))
            b.close()  # as the server does: the rest of the frame is never read
        feeder.join(5)


@pytest.mark.parametrize("move", ["swapped", "repeated", "dropped"])
def test_payload_pieces_moved_within_a_frame_fail_even_with_their_own_tags(move):
    """Each piece's tag binds its place in the frame: two pieces swapped, one sent twice
    or one left out never verify."""
    payload = np.random.default_rng(1).integers(0, 256, 3 * STREAM_CHUNK, dtype=np.uint8).tobytes()
    frame = _large_frame_bytes(payload)
    start = ECHO.header.size + TAG_BYTES
    head, pieces = frame[:start], [frame[start + i * PIECE : start + (i + 1) * PIECE] for i in range(3)]
    body = {
        "swapped": [pieces[1], pieces[0], pieces[2]],
        "repeated": [pieces[0], pieces[0], pieces[2]],
        "dropped": [pieces[0], pieces[2]],
    }[move]
    a, b, _, server = pair()
    with a, b:
        feeder = feeding(a, head + b"".join(body))
        with pytest.raises(ProtocolError, match="authentication"):  # dropped: the third's tag, second place
            server.recv(len(payload))
        b.close()
        feeder.join(5)


def _wire_of(payload, encrypt):
    """Every byte a client channel puts on the wire for one frame of ``payload``."""
    x, y = socket.socketpair()
    with x, y:
        channel = Channel(x, SECRET, ECHO, NONCE, client=True, encrypt=encrypt)

        def send():
            channel.send((EchoKind.DATA, (1, 2), payload))
            x.shutdown(socket.SHUT_WR)  # then the reader sees the end

        sender = threading.Thread(target=send)
        sender.start()
        y.settimeout(5)
        wire = bytearray()
        while chunk := y.recv(1 << 20):
            wire += chunk
        sender.join(5)
        return bytes(wire)


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
def test_each_frame_takes_the_bytes_frame_bytes_says_and_an_empty_payload_has_no_tag(encrypt):
    assert frame_bytes(ECHO.header.size, 0) == ECHO.header.size + TAG_BYTES
    for n in [0, 1, STREAM_CHUNK, STREAM_CHUNK + 1, 2 * STREAM_CHUNK + 7]:
        payload = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
        wire = _wire_of(payload, encrypt)
        tags = -(-n // STREAM_CHUNK)  # a tag per piece, plain or encrypted
        assert len(wire) == frame_bytes(ECHO.header.size, n)
        if encrypt and n >= 16:  # (one byte may well occur in random ciphertext)
            assert payload[: min(n, 64)] not in wire  # ciphertext
        assert len(wire) == ECHO.header.size + n + (1 + tags) * TAG_BYTES
        a, b = socket.socketpair()
        with a, b:
            b.settimeout(5)
            server = Channel(b, SECRET, ECHO, NONCE, client=False, encrypt=encrypt)
            feeder = feeding(a, wire)
            assert server.recv(len(payload))[2] == payload
            feeder.join(5)


class Refusing(Echo):
    """The echo protocol, refusing to encode a message whose first field is 666."""

    def encode(self, message):
        if message[1][0] == 666:
            raise ValueError("not encodable")
        return message


@pytest.mark.parametrize(
    ("batch", "wait"),
    [
        ([(EchoKind.DATA, (1, 0), b"s" * (2 * STREAM_CHUNK + 3)), (EchoKind.DATA, (666, 0), b"")], True),
        ([(EchoKind.DATA, (1, 0), b"small"), (EchoKind.DATA, (2, 0), b"L" * (STREAM_CHUNK + 1))], False),
    ],
    ids=["a message that does not encode", "a large frame without waiting"],
)
def test_a_batch_refused_by_send_many_sends_nothing_and_spends_no_sequence_number(batch, wait):
    """Every frame of a batch is encoded and checked before any is sent: a refusal leaves
    neither half a frame on the wire nor a gap in the sequence numbers."""
    protocol = Refusing("test-echo", ident=9, fields="IQ", hello_kind=EchoKind.HELLO)
    a, b, client, server = pair(protocol)
    with a, b:
        with pytest.raises(ValueError):
            client.send_many(batch, wait=wait)
        assert not server.pending(0.2)  # nothing of the batch left
        client.send((EchoKind.DATA, (7, 7), b"next"))
        assert server.recv(1024) == (EchoKind.DATA, (7, 7), b"next")  # the sequence stayed in step


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
def test_a_payload_lands_in_a_placement_of_any_element_type(encrypt):
    values = np.arange(3 * STREAM_CHUNK // 4 + 3, dtype=np.float32)  # pieces that split floats
    target = np.zeros_like(values)
    a, b, client, server = pair(encrypt=encrypt)
    with a, b:
        sender = threading.Thread(target=client.send, args=((EchoKind.DATA, (1, 2), values.data),))
        sender.start()
        server.recv(values.nbytes, into=lambda kind, fields, length: memoryview(target))
        sender.join(10)
    assert np.array_equal(target, values)


@pytest.mark.parametrize("size", [100, 2 * STREAM_CHUNK + 9], ids=["one piece", "three pieces"])
def test_a_forged_encrypted_piece_never_lands_in_the_callers_memory(size):
    """Before, an encrypted payload was opened whole into the caller's memory and its tag
    checked at the end: a forged frame's plaintext (the ciphertext with a bit flipped, an
    attacker's edit) sat in the parameter server's weights before the frame was refused.
    Now each piece is opened aside and copied only once its tag holds: the pieces before the
    forged one are authentic, the forged one and those after it never arrive."""
    payload = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8).tobytes()
    wire = bytearray(_wire_of(payload, encrypt=True))
    start = ECHO.header.size + TAG_BYTES
    forged = start + (PIECE if size > STREAM_CHUNK else 0) + 7  # in the second piece, or the only one
    wire[forged] ^= 0x40
    target = np.full(size, 0xAB, dtype=np.uint8)
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        server = Channel(b, SECRET, ECHO, NONCE, client=False, encrypt=True)
        feeder = feeding(a, bytes(wire))
        with pytest.raises(ProtocolError, match="authentication"):
            server.recv(size, into=lambda kind, fields, length: memoryview(target))
        b.close()
        feeder.join(5)
    authentic = STREAM_CHUNK if size > STREAM_CHUNK else 0
    assert target[:authentic].tobytes() == payload[:authentic]
    assert (target[authentic:] == 0xAB).all()  # nothing of the forged piece, or after it


def test_encrypted_pieces_moved_within_a_frame_fail():
    payload = np.random.default_rng(6).integers(0, 256, 2 * STREAM_CHUNK, dtype=np.uint8).tobytes()
    wire = _wire_of(payload, encrypt=True)
    start = ECHO.header.size + TAG_BYTES
    head, first, second = wire[:start], wire[start : start + PIECE], wire[start + PIECE :]
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        server = Channel(b, SECRET, ECHO, NONCE, client=False, encrypt=True)
        feeder = feeding(a, head + second + first)
        with pytest.raises(ProtocolError, match="authentication"):
            server.recv(len(payload))
        b.close()
        feeder.join(5)


def test_a_payload_whose_piece_would_repeat_the_headers_nonce_is_refused_both_ways(monkeypatch):
    """The last piece index a payload may reach is just under the header's (about 4 PiB of
    payload); the bound, lowered here to 100 bytes, holds on both ends."""
    a, b, client, server = pair()
    with a, b:
        client.send((EchoKind.DATA, (1, 0), b"x" * 101))  # sent under the real bound
        monkeypatch.setattr(wire_layout, "MAX_FRAME_PAYLOAD", 100)
        placed = []
        with pytest.raises(ProtocolError, match="carries at most 100"):
            server.recv(1 << 20, into=lambda *frame: placed.append(frame))
        assert placed == []  # refused before any placement
    a, b, client, server = pair()
    with a, b:
        with pytest.raises(ProtocolError, match="carries at most 100"):
            client.send((EchoKind.DATA, (2, 0), b"y" * 101))
        client.send((EchoKind.DATA, (3, 0), b"z" * 100))
        assert server.recv(1024)[2] == b"z" * 100  # the refused frame spent no sequence number


def test_a_replayed_frame_fails():
    first, _ = sent_bytes(ECHO, [(EchoKind.DATA, (1, 0), b"a"), (EchoKind.DATA, (2, 0), b"b")])
    a, b, _, server = pair()
    with a, b:
        a.sendall(first)
        assert server.recv(1024)[1] == (1, 0)
        a.sendall(first)  # the same frame again: its sequence number is spent
        with pytest.raises(ProtocolError, match="replayed"):
            server.recv(1024)


def test_reordered_frames_fail():
    first, second = sent_bytes(ECHO, [(EchoKind.DATA, (1, 0), b"a"), (EchoKind.DATA, (2, 0), b"b")])
    a, b, _, server = pair()
    with a, b:
        a.sendall(second + first)
        with pytest.raises(ProtocolError, match="reordered"):
            server.recv(1024)


def test_a_reflected_frame_fails():
    """The server's own frame sent back to it: same nonce and sequence, other direction."""
    (reflected,) = sent_bytes(ECHO, [(EchoKind.DATA, (1, 0), b"a")], client=False)
    a, b, _, server = pair()
    with a, b:
        a.sendall(reflected)
        with pytest.raises(ProtocolError, match="reflected"):
            server.recv(1024)


def answer(client_protocol, hello, secret=SECRET, server_protocol=None):
    """The HELLO a client of ``client_protocol`` sends in answer to a fresh challenge of
    ``server_protocol``'s id: (the challenge, the HELLO's bytes)."""
    challenge = server_challenge(server_protocol or client_protocol, KEY)
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        b.settimeout(5)
        b.sendall(challenge.data)
        client_hello(a, secret, client_protocol, hello, server_key=KEY.public)
        raw = b""
        while len(raw) < client_protocol.hello_size:
            raw += b.recv(4096)
    return challenge, raw


def accept(raw, challenge, protocol=ECHO, secret=SECRET):
    a, b = socket.socketpair()
    with a, b:
        return accept_hello(b, raw, challenge, secret, protocol)


def test_frames_of_one_protocol_never_pass_as_the_other():
    # a progress HELLO at a parameter server: refused by its protocol id
    challenge, raw = answer(PROGRESS_WIRE, Hello(0, 0))
    with pytest.raises(ProtocolError, match="protocol 2 on a sparkdl-ps connection"):
        accept(raw, challenge, PS_WIRE)
    # a forger that copies the parameter server's id and layout under another name: the
    # keys differ, so neither its HELLO nor its frames verify
    forged = type(PS_WIRE)("sparkdl-progress", PS_WIRE.ident, "BBHIIQQQQIQQ", Kind.HELLO)
    challenge, raw = answer(forged, Frame(Kind.HELLO))
    with pytest.raises(ProtocolError, match="sparkdl-ps HELLO failed authentication"):
        accept(raw, challenge, PS_WIRE)
    a, b, client, server = pair(PS_WIRE, client_protocol=forged)
    with a, b:
        client.send(Frame(Kind.PULL, clock=3))
        with pytest.raises(ProtocolError, match="authentication"):
            server.recv(1024)


def test_a_client_refuses_a_server_of_another_protocol_before_it_says_anything():
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        b.sendall(server_challenge(PS_WIRE, KEY).data)
        with pytest.raises(ProtocolError, match="protocol 1 on a sparkdl-progress connection"):
            client_hello(a, SECRET, PROGRESS_WIRE, Hello(0, 0), server_key=KEY.public)
        b.settimeout(0.2)
        with pytest.raises(TimeoutError):
            b.recv(1)  # no HELLO was sent


def test_a_hello_answers_one_challenge_only():
    challenge, raw = answer(ECHO, (EchoKind.HELLO, (0, 0), b""))
    hello, _ = accept(raw, challenge)
    assert hello == (EchoKind.HELLO, (0, 0), b"")
    with pytest.raises(ProtocolError, match="replayed HELLO"):  # the same HELLO, a new challenge
        accept(raw, server_challenge(ECHO, KEY))


def test_a_clean_eof_is_connection_closed_but_a_truncated_frame_is_a_protocol_error():
    a, b, _, server = pair()
    with b:
        a.close()
        with pytest.raises(ConnectionClosed):
            server.recv(1024)
    (frame,) = sent_bytes(ECHO, [(EchoKind.DATA, (1, 0), b"abc")])
    size = ECHO.header.size
    for cut in (5, size + 3, size + TAG_BYTES + 1, len(frame) - 1):  # header, its tag, payload, tag
        a, b, _, server = pair()
        with b:
            a.sendall(frame[:cut])
            a.close()
            with pytest.raises(ProtocolError, match="truncated") as raised:
                server.recv(1024)
            assert not isinstance(raised.value, ConnectionClosed)


def test_an_oversized_frame_is_refused_before_its_payload_is_read():
    a, b, client, server = pair()
    with a, b:
        client.send((EchoKind.DATA, (0, 0), b"p" * 100))
        with pytest.raises(ProtocolError, match=r"announces 100 payload bytes, over the cap of 64"):
            server.recv(64)
        b.settimeout(0.5)
        unread = b.recv(1000)
        assert len(unread) == 100 + TAG_BYTES and unread[:100] == b"p" * 100  # payload and tag


def test_a_forged_header_allocates_nothing_and_reads_no_payload():
    """Without the secret, a header announcing 1 GiB fails on its own tag: the reader
    neither allocates the payload nor reads a byte past the header's tag."""
    import tracemalloc

    a, b, _, server = pair()
    with a, b:
        a.sendall(ECHO.pack(EchoKind.DATA, (0, 0), 1 << 30) + b"t" * TAG_BYTES + b"first payload bytes")
        tracemalloc.start()
        try:
            with pytest.raises(ProtocolError, match="authentication"):
                server.recv(1 << 31)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20
        assert b.recv(100) == b"first payload bytes"  # still unread


def test_a_hello_under_another_secret_is_refused():
    challenge, raw = answer(ECHO, (EchoKind.HELLO, (0, 0), b""), secret=b"x" * 32)
    with pytest.raises(ProtocolError, match="HELLO failed authentication"):
        accept(raw, challenge)


# --- the parameter server's errors are data -------------------------------------------


@pytest.mark.parametrize(
    "error, code, raised",
    [
        (PsAborted("rank 0 stopped: loss was nan"), ErrorCode.ABORTED, PeerStopped),
        (PsTimeoutError("rank 3: pull of clock 2 waited 5s"), ErrorCode.TIMEOUT, PsTimeoutError),
        (PushRejected("duplicate clock"), ErrorCode.REJECTED, PushRejected),
        (CheckpointError("no snapshot of step 4"), ErrorCode.CHECKPOINT, CheckpointError),
        (ParameterServerError("anything else"), ErrorCode.REFUSED, ParameterServerError),
    ],
)
def test_each_error_crosses_the_wire_as_its_code_and_comes_back_as_its_class(error, code, raised):
    a, b, client, server = pair(PS_WIRE)
    with a, b:
        server.send(error_frame(error, shard=1))
        frame = client.recv(1024)
    assert frame.kind is Kind.ERROR and frame.error is code and frame.shard == 1
    result = error_of(frame, rank=3)
    assert type(result) is raised
    assert result.message.startswith("rank 3: ") and result.message.endswith(error.message)
    assert result.agreed_by_all_ranks is (code is ErrorCode.ABORTED)


def test_the_class_follows_the_code_never_the_wording():
    wording = "aborted: waited 5s"  # what the old client matched on
    frame = Frame(Kind.ERROR, payload=wording.encode(), error=ErrorCode.REFUSED)
    assert type(error_of(frame, 0)) is ParameterServerError
    assert type(error_of(Frame(Kind.ERROR, payload=b"slow", error=ErrorCode.TIMEOUT), 0)) is PsTimeoutError


@pytest.mark.parametrize(
    "frame, refusal",
    [
        (Frame(Kind.ERROR), "ERROR frame with error code NONE"),
        (Frame(Kind.ACK, error=ErrorCode.TIMEOUT), "ACK frame with error code TIMEOUT"),
    ],
)
def test_an_error_code_only_comes_with_an_error_frame(frame, refusal):
    a, b, client, server = pair(PS_WIRE)
    with a, b:
        server.send(frame)
        with pytest.raises(ProtocolError, match=refusal):
            client.recv(1024)


class Raw(WireProtocol):
    """Speaks another protocol's name and layout with raw (kind, fields, payload) tuples."""

    def __init__(self, like):
        super().__init__(like.name, like.ident, like.header.format[len(PREFIX.format) :], like.hello_kind)

    def encode(self, message):
        return message

    def decode(self, kind, fields, payload):
        return kind, fields, payload


@pytest.mark.parametrize(
    "kind, error, refusal",
    [(Kind.ERROR, 99, "unknown sparkdl-ps ErrorCode 99"), (42, 0, "unknown sparkdl-ps Kind 42")],
)
def test_an_authentic_frame_of_an_unknown_kind_or_error_code_is_refused(kind, error, refusal):
    a, b, client, _ = pair(PS_WIRE)
    with a, b:
        Channel(b, SECRET, Raw(PS_WIRE), NONCE, client=False).send(
            (kind, (1, error, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), b"")
        )
        with pytest.raises(ProtocolError, match=refusal):
            client.recv(1024)


# --- progress heartbeats and silence --------------------------------------------------


class Recorder:
    """A driver that records every progress message with the time it arrived."""

    def __init__(self):
        self.messages: list[tuple[float, object]] = []
        self.listener = ConnectionListener(
            "127.0.0.1", PROGRESS_WIRE, SECRET, self._serve, "test-net-progress", log
        )

    def endpoint(self, interval_s=10.0):
        return ProgressEndpoint(
            self.listener.host, self.listener.port, SECRET, self.listener.public_key, interval_s
        )

    def _serve(self, hello, channel, peer):
        try:
            channel.send(Ack(hello.rank, hello.attempt))
            while True:
                message = channel.recv(MAX_PAYLOAD)
                self.messages.append((time.monotonic(), message))
        except (ProtocolError, OSError):
            pass

    def kinds(self):
        return [type(m).__name__ for _, m in self.messages]


def test_a_reporter_sends_heartbeats_only_while_it_has_nothing_else_to_say():
    driver = Recorder()
    reporter = ProgressReporter(driver.endpoint(), rank=2, attempt=1, heartbeat_s=0.5)
    try:
        busy_until = time.monotonic() + 1.2
        while time.monotonic() < busy_until:  # a frame every 50 ms: no gap for a heartbeat
            reporter.log(logging.WARNING, "busy")
            time.sleep(0.05)
        assert wait_until(lambda: driver.kinds()[-3:] == ["Heartbeat"] * 3, timeout=10)
    finally:
        reporter.close()
        driver.listener.stop(timeout=5)
    kinds = driver.kinds()
    first_beat = kinds.index("Heartbeat")
    assert set(kinds[:first_beat]) == {"Log"} and first_beat >= 15
    assert kinds[-1] == "Goodbye"  # close() ends the session
    beats = driver.messages[first_beat:-1]
    assert all(isinstance(m, Heartbeat) and (m.rank, m.attempt) == (2, 1) for _, m in beats)
    times = [t for t, _ in driver.messages[first_beat - 1 : -1]]  # the last log, then the beats
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert all(gap > 0.3 for gap in gaps), gaps  # one heartbeat per heartbeat_s of silence
    assert not any(
        t.name.startswith("sparkdl-progress-heartbeat") and t.is_alive() for t in threading.enumerate()
    )


def test_heartbeats_keep_a_rank_from_going_silent_on_the_driver():
    now = [100.0]
    server = ProgressServer(ProgressBoard(2, 1, show=False), "127.0.0.1", SECRET, 10.0, clock=lambda: now[0])
    quiet = ProgressReporter(server.endpoint(), rank=0, attempt=0)
    beating = ProgressReporter(server.endpoint(), rank=1, attempt=0, heartbeat_s=0.05)
    try:
        assert wait_until(lambda: set(server.silence()) == {0, 1})
        assert server.silence() == {0: 0.0, 1: 0.0}
        now[0] = 130.0  # half a minute on the driver's clock
        assert wait_until(lambda: server.silence()[1] == 0.0)  # a heartbeat arrived since
        time.sleep(0.3)
        assert server.silence()[0] == 30.0  # rank 0 sent nothing
        quiet.log(logging.WARNING, "still here")
        assert wait_until(lambda: server.silence()[0] == 0.0)  # any frame counts
    finally:
        beating.close()
        quiet.close()
        server.stop()
    threads = [t.name for t in threading.enumerate() if t.is_alive()]
    assert not any(name.startswith("sparkdl-progress") for name in threads), threads


def test_silence_covers_only_the_ranks_of_the_newest_stage_attempt():
    now = [0.0]
    server = ProgressServer(ProgressBoard(2, 1, show=False), "127.0.0.1", SECRET, 10.0, clock=lambda: now[0])
    old = ProgressReporter(server.endpoint(), rank=0, attempt=3)
    try:
        assert wait_until(lambda: server.silence() == {0: 0.0})
        new = ProgressReporter(server.endpoint(), rank=1, attempt=4)
        try:
            assert wait_until(lambda: server.silence() == {1: 0.0})
            now[0] = 5.0
            old.log(logging.WARNING, "a late record of the failed attempt")
            time.sleep(0.3)
            assert server.silence() == {1: 5.0}  # rank 0 never said HELLO in attempt 4
        finally:
            new.close()
    finally:
        old.close()
        server.stop()


def test_reporting_to_driver_passes_the_heartbeat_on_and_stops_it():
    driver = Recorder()
    try:
        with reporting_to_driver(driver.endpoint(), rank=3, attempt=0, heartbeat_s=0.05) as reporter:
            assert reporter is not None
            assert wait_until(lambda: "Heartbeat" in driver.kinds())
            beat = [t for t in threading.enumerate() if t.name.startswith("sparkdl-progress-heartbeat")]
            assert len(beat) == 1 and beat[0].daemon
        assert not beat[0].is_alive()
        with reporting_to_driver(driver.endpoint(), rank=4, attempt=0) as reporter:
            time.sleep(0.2)
            assert not any(t.name.startswith("sparkdl-progress-heartbeat") for t in threading.enumerate())
    finally:
        driver.listener.stop(timeout=5)
    assert all(isinstance(m, Heartbeat | Log | Goodbye) for _, m in driver.messages)
    assert driver.kinds().count("Goodbye") == 2  # each reporter's session ended by its goodbye


@pytest.mark.parametrize("heartbeat_s", [0.0, -1.0])
def test_the_heartbeat_interval_must_be_positive(heartbeat_s):
    driver = Recorder()
    try:
        with pytest.raises(ConfigError, match="heartbeat_s must be a positive number of seconds"):
            ProgressReporter(driver.endpoint(), rank=0, attempt=0, heartbeat_s=heartbeat_s)
    finally:
        driver.listener.stop(timeout=5)


# --- several frames in one sendmsg, and whether a read would wait ------------------------


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
def test_frames_sent_together_arrive_in_order_whatever_their_sizes(encrypt):
    """send_many: small frames share a sendmsg, a streamed one goes alone, anywhere in the
    batch; encrypted frames copy their ciphertext when another frame follows."""
    a, b, client, server = pair(encrypt=encrypt)
    with a, b:
        rng = np.random.default_rng(0)
        sizes = [0, 100, STREAM_CHUNK + 1, 5, 3 * STREAM_CHUNK, 0]
        frames = [(EchoKind.DATA, (i, n), rng.bytes(n)) for i, n in enumerate(sizes)]
        got = []
        reader = threading.Thread(target=lambda: got.extend(server.recv(1 << 22) for _ in frames))
        reader.start()
        sent = client.send_many(frames)
        reader.join(10)
        assert got == frames
        assert sent == sum(frame_bytes(ECHO.header.size, n) for n in sizes)
        client.send((EchoKind.DATA, (9, 9), b"after"))  # the sequence numbers stayed in step
        assert server.recv(1024)[2] == b"after"


def test_pending_says_whether_a_read_would_wait_and_never_waits_itself():
    a, b, client, server = pair()
    with a, b:
        b.settimeout(5)  # a timeout makes CPython wait before a recv: pending must not
        started = time.monotonic()
        assert not server.pending()
        assert time.monotonic() - started < 0.5
        client.send((EchoKind.DATA, (1, 2), b"x"))
        assert wait_until(server.pending)
        server.recv(1024)
        assert not server.pending()
        a.close()
        assert server.pending()  # the end of the connection: a read returns at once


def test_pending_waits_up_to_its_timeout_for_the_peers_bytes():
    a, b, client, server = pair()
    with a, b:
        started = time.monotonic()
        assert not server.pending(0.3)
        assert 0.25 < time.monotonic() - started < 3
        threading.Timer(0.2, lambda: client.send((EchoKind.DATA, (1, 2), b"x"))).start()
        started = time.monotonic()
        assert server.pending(10)  # returns as the bytes land, not at the timeout
        assert time.monotonic() - started < 5
        assert server.recv(1024)[2] == b"x"
        threading.Timer(0.2, lambda: client.send((EchoKind.DATA, (1, 2), b"z"))).start()
        assert server.pending(float("inf"))  # over poll()'s longest wait: waits that long at most
        assert server.recv(1024)[2] == b"z"


def test_send_many_without_waiting_raises_once_the_peer_leaves_its_bytes_unread():
    a, b, client, server = pair()
    a.setblocking(True)  # as the server's sockets are: no timeout of CPython's own to wait out
    with a, b:
        with pytest.raises(ValueError, match="cannot be sent without waiting"):
            client.send_many([(EchoKind.DATA, (1, 2), b"x" * (STREAM_CHUNK + 1))], wait=False)
        sent = 0
        with pytest.raises(BlockingIOError):
            for _ in range(100_000):  # the peer reads nothing: the buffers fill within a few MB
                sent += client.send_many([(EchoKind.DATA, (1, 2), b"y" * 1000)], wait=False)
        assert 0 < sent < 100_000 * 1000
        assert server.recv(1 << 20)[2] == b"y" * 1000  # what went before is intact


@pytest.mark.parametrize("encrypt", [False, True], ids=["tagged", "encrypted"])
def test_threads_sending_on_one_channel_never_share_a_sequence_number_or_interleave(encrypt):
    """Two threads send on one channel at once: each frame takes its own sequence number
    (a GCM nonce used twice would leak the key stream) and leaves whole, so the reader
    authenticates every frame, in some order, each payload intact. Bounded: 2 x 300 frames."""
    a, b, client, server = pair(encrypt=encrypt)
    frames = 300
    received: list = []
    reader = threading.Thread(target=lambda: received.extend(server.recv(1 << 20) for _ in range(2 * frames)))
    reader.start()

    def send(tag: int) -> None:
        for i in range(frames):
            client.send((EchoKind.DATA, (tag, i), bytes([tag]) * (64 + i % 7)))

    with a, b:
        senders = [threading.Thread(target=send, args=(t,)) for t in (1, 2)]
        for thread in senders:
            thread.start()
        for thread in senders:
            thread.join(30)
        reader.join(30)
    assert len(received) == 2 * frames
    for tag in (1, 2):
        mine = [fields[1] for _, fields, payload in received if fields[0] == tag]
        assert mine == list(range(frames))  # each sender's frames in its own order, all there
    assert all(payload == bytes([fields[0]]) * (64 + fields[1] % 7) for _, fields, payload in received)


# --- forward secrecy ---------------------------------------------------------------------


def _replay_to(transcript: bytes, recorded: bytes):
    """What a server-side channel keyed by ``transcript`` makes of ``recorded`` bytes."""
    x, y = socket.socketpair()
    with x, y:
        y.settimeout(5)
        x.sendall(recorded)
        return Channel(y, SECRET, ECHO, transcript, client=False, encrypt=True).recv(1 << 20)


def test_a_recorded_session_stays_sealed_to_whoever_learns_the_secret_later():
    # A full handshake and one encrypted frame, recorded as a listener on the wire sees them.
    challenge = server_challenge(ECHO, KEY, encrypt=True)
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        b.settimeout(5)
        b.sendall(challenge.data)
        client = client_hello(
            a, SECRET, ECHO, (EchoKind.HELLO, (0, 0), b""), encrypt=True, server_key=KEY.public
        )
        hello = b""
        while len(hello) < ECHO.hello_size:
            hello += b.recv(4096)
        size = client.send((EchoKind.DATA, (1, 2), b"the weights of a model " * 4))
        recorded = b""
        while len(recorded) < size:
            recorded += b.recv(65536)
    assert b"the weights" not in recorded
    client_nonce = hello[ECHO.header.size : ECHO.header.size + NONCE_BYTES]
    server_nonce = challenge.data[8 : 8 + NONCE_BYTES]
    client_public = hello[ECHO.header.size + NONCE_BYTES : ECHO.header.size + NONCE_BYTES + 32]
    # Whoever holds the secret, the recording and even the server's static key, but neither
    # ephemeral private key: the keys of version 6 (the nonces alone) open nothing, nor does
    # the static exchange alone or with a guess of the ephemeral one.
    static = KEY.exchange(client_public, ECHO)
    said = hashlib.sha256(challenge.data + hello[: ECHO.header.size + NONCE_BYTES + 32]).digest()
    for guess in (b"", bytes(32) + static + said, client_public + static + said, static + said):
        with pytest.raises(ProtocolError, match="authentication"):
            _replay_to(client_nonce + server_nonce + guess, recorded)
    # The server's ephemeral key (gone after a real handshake) is what it takes.
    shared = challenge.ephemeral.exchange(X25519PublicKey.from_public_bytes(client_public))
    kind, fields, payload = _replay_to(client_nonce + server_nonce + shared + static + said, recorded)
    assert (kind, fields, payload) == (EchoKind.DATA, (1, 2), b"the weights of a model " * 4)


def test_a_hello_whose_ephemeral_key_was_swapped_fails_authentication():
    challenge, raw = answer(ECHO, (EchoKind.HELLO, (0, 0), b""))
    at = ECHO.header.size + NONCE_BYTES
    swapped = raw[:at] + X25519PrivateKey.generate().public_key().public_bytes_raw() + raw[at + 32 :]
    with pytest.raises(ProtocolError, match="failed authentication"):  # the tag covers the key
        accept(swapped, challenge)
