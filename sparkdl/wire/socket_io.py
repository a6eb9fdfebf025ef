"""The framing's socket calls: scatter/gather sends and receives, and reused buffers.

A small frame leaves in one ``sendmsg`` (the plaintext payload uncopied: its parts are
views); a payload piece and its tag are read with one ``recvmsg_into``. Memory written or
read frame after frame is reused rather than allocated fresh each time (see
:class:`ReusedBuffer`). Nothing here authenticates anything: the channel and the handshake
decide what is read and check it.
"""

from __future__ import annotations

import socket

from sparkdl.errors import ConnectionClosed, ProtocolError, ServerBusy

#: What a listener sends, then closes, to a handshake it turns away (its pending handshakes
#: full): never the start of a challenge or a frame (their magic is b"SDNT"), so a client
#: knows to try again rather than take it for a refused HELLO.
BUSY = b"SDBZ"


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


def send_parts(sock: socket.socket, parts: list[memoryview], flags: int = 0) -> None:
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


def recv_exactly(sock: socket.socket, count: int, at_frame_start: bool = False) -> bytearray:
    """``count`` bytes from ``sock`` (see :func:`recv_into` for the errors)."""
    buffer = bytearray(count)
    recv_into(sock, [memoryview(buffer)], at_frame_start)
    return buffer


def recv_into(sock: socket.socket, views: list[memoryview], at_frame_start: bool = False) -> None:
    """Fill ``views`` in order from ``sock``, in one ``recvmsg_into`` when the bytes are there.

    Raises:
        ConnectionClosed: the peer closed before the first byte, where ``at_frame_start``.
        ServerBusy: the peer sent :data:`BUSY` and closed, where ``at_frame_start``.
        ProtocolError: the peer closed part way (a truncated frame).
    """
    count = sum(v.nbytes for v in views)
    views = [v for v in views if v.nbytes]
    first = views[0] if views else memoryview(b"")
    received = 0
    while views:
        n = sock.recvmsg_into(views)[0] if len(views) > 1 else sock.recv_into(views[0])
        if n == 0:
            if received == 0 and at_frame_start:
                raise ConnectionClosed("the peer closed the connection")
            if at_frame_start and received == len(BUSY) and bytes(first[: len(BUSY)]) == BUSY:
                raise ServerBusy("the server turned the handshake away: its pending handshakes were full")
            raise ProtocolError(
                f"connection closed after {received} of the {count} bytes expected next (truncated frame)"
            )
        received += n
        _consume(views, n)
