"""What the driver's servers say about the peers they refuse, in the log: counted by reason,
rate-limited, every peer's text escaped (a peer can neither flood the log nor forge a line
of it); and how a socket is closed when its peer may be gone already."""

from __future__ import annotations

import logging
import socket
import threading
import time


def one_line(text: str, limit: int = 8000) -> str:
    """Text a peer sent, made safe for one log line: control characters (newlines too)
    escaped, at most ``limit`` characters, so that no peer can forge a line of the log."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


class Refusals:
    """Refused connections and frames, counted by reason; a log line for the first of each
    reason, then at most one per reason and ``every_s`` seconds, with the count since.

    Reasons are short fixed strings chosen by our code, never by a peer, so the counts stay
    bounded however many connections are refused; only the latest detail of each is kept.
    """

    def __init__(self, name: str, logger: logging.Logger, every_s: float = 30.0) -> None:
        self.name = name
        self._log = logger
        self._every_s = every_s
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self._unlogged: dict[str, int] = {}
        self._logged_at: dict[str, float] = {}

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def add(self, reason: str, peer: object, detail: str = "") -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[reason] = self.counts.get(reason, 0) + 1
            last = self._logged_at.get(reason)
            if last is not None and now - last < self._every_s:
                self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
                return
            more = self._unlogged.pop(reason, 0)
            since = now - last if last is not None else 0.0
            self._logged_at[reason] = now
        said = f"{reason}: {one_line(detail, 1000)}" if detail else reason
        if more:
            self._log.warning(
                "%s refused %s: %s (and %d more like it in the last %.0f s)",
                self.name,
                peer,
                said,
                more,
                since,
            )
        else:
            self._log.warning("%s refused %s: %s", self.name, peer, said)

    def flush(self) -> None:
        """Log the counts not logged yet (at the end of a server's life)."""
        with self._lock:
            unlogged, self._unlogged = self._unlogged, {}
        for reason, count in unlogged.items():
            self._log.warning("%s refused %d more: %s", self.name, count, reason)


#: TCP keepalive on a session's socket: probes after this long idle, this often, this many.
KEEPALIVE = (30, 10, 6)


def keep_alive(
    sock: socket.socket, idle_s: int = KEEPALIVE[0], interval_s: int = KEEPALIVE[1], count: int = KEEPALIVE[2]
) -> None:
    """Have the kernel probe ``sock``'s peer once it has been idle ``idle_s``: a peer whose host
    died or was cut off (no FIN ever comes) is found gone after about ``idle_s + interval_s *
    count`` seconds and its session ends, instead of holding a thread and a place for the
    server's life. A legitimately idle peer answers the probes and is never cut."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", count)):
        if hasattr(socket, option):  # Linux; macOS has TCP_KEEPALIVE for the idle time
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def close_quietly(sock: socket.socket) -> None:
    """Shut down and close ``sock``, ignoring a peer that is already gone."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
