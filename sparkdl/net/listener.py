"""A listening socket on the driver with a thread per connection, stopped in bounded time.

Both driver-side servers use it: the parameter server (:mod:`sparkdl.ps.server`) and the
progress channel (:mod:`sparkdl.progress.channel`).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

_ACCEPT_POLL_S = 0.2

Serve = Callable[[socket.socket, tuple[str, int]], None]


class ConnectionListener:
    """Listens on ``(host, port 0)`` and runs ``serve(sock, peer)`` in a thread per connection.

    ``serve`` owns its socket (it should close it when done); :meth:`stop` closes
    whatever is still open.
    """

    def __init__(self, host: str, serve: Serve, name: str) -> None:
        self._serve = serve
        self._name = name
        self._socket = socket.create_server((host, 0), backlog=64)
        self._socket.settimeout(_ACCEPT_POLL_S)
        self.host, self.port = host, self._socket.getsockname()[1]
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._connections: list[tuple[socket.socket, threading.Thread]] = []
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._acceptor.start()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called: a connection's end is then expected, not an error."""
        return self._stopping.is_set()

    def stop(self, timeout: float = 10.0, drain_s: float = 0.0) -> None:
        """Close the port; give open connections up to ``drain_s`` to finish by themselves
        (their peers are done and at EOF), then close them and join every thread (bounded)."""
        self._stopping.set()
        self._acceptor.join(timeout)
        self._socket.close()
        with self._lock:
            connections = list(self._connections)
        deadline = time.monotonic() + drain_s
        for _, thread in connections:
            thread.join(max(deadline - time.monotonic(), 0.0))
        for sock, _ in connections:
            close_quietly(sock)
        for _, thread in connections:
            thread.join(timeout)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, peer = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(
                target=self._serve, args=(sock, peer), name=f"{self._name}-{peer[1]}", daemon=True
            )
            with self._lock:
                self._connections.append((sock, thread))
            thread.start()


def close_quietly(sock: socket.socket) -> None:
    """Shut down and close ``sock``, ignoring a peer that is already gone."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
