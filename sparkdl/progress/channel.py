"""The driver-side progress channel: workers report over an authenticated socket.

The driver listens on its own address (port chosen by the OS) for the length of one
``fit``; each worker opens one connection, says HELLO under the fit's secret (the
parameter server's frame format, :mod:`sparkdl.ps.protocol`), then sends PROGRESS
frames at most every ``progress_interval_s`` and LOG frames for its warnings and
errors. Nothing is ever answered after the HELLO's ACK, so a worker never waits on
the driver; if the driver cannot be reached, the worker trains on without reports.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sparkdl.errors import ConnectionClosed
from sparkdl.progress.board import ProgressBoard, Report
from sparkdl.ps.listener import ConnectionListener, close_quietly
from sparkdl.ps.protocol import Channel, Frame, Kind, ProtocolError, client_hello, server_hello

log = logging.getLogger(__name__)
worker_log = logging.getLogger("sparkdl.worker")

_MAX_PAYLOAD = 64 * 1024
_MAX_LOG_CHARS = 8000


@dataclass(frozen=True)
class ProgressEndpoint:
    """Where workers report; shipped inside the task spec."""

    host: str
    port: int
    secret: bytes
    interval_s: float


class ProgressServer:
    """Receives reports and worker log records on the driver until :meth:`stop`."""

    def __init__(self, board: ProgressBoard, host: str, secret: bytes, interval_s: float) -> None:
        self.board = board
        self._secret = secret
        self._interval_s = interval_s
        self._listener = ConnectionListener(host, self._serve, "sparkdl-progress")
        self.host, self.port = self._listener.host, self._listener.port

    def endpoint(self) -> ProgressEndpoint:
        return ProgressEndpoint(self.host, self.port, self._secret, self._interval_s)

    def stop(self, timeout: float = 5.0, drain_s: float = 2.0) -> None:
        """Close the port; let each connection read what its worker sent before it closed
        (up to ``drain_s``: the tasks are over, their sockets at EOF), then close every
        connection, join the threads (bounded) and close the bar."""
        self._listener.stop(timeout, drain_s)
        self.board.close()

    def _serve(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        try:
            _, channel = server_hello(sock, self._secret)
            channel.send(Frame(Kind.ACK))
            while True:  # until the worker closes (EOF) or stop() closes the socket
                frame = channel.recv(_MAX_PAYLOAD)
                if frame.kind is Kind.PROGRESS:
                    self.board.update(Report.unpack(frame.rank, frame.shard, frame.attempt, frame.payload))
                elif frame.kind is Kind.LOG:
                    text = bytes(frame.payload).decode(errors="replace")
                    worker_log.log(frame.shard or logging.WARNING, "[rank %d] %s", frame.rank, text)
                else:
                    raise ProtocolError(f"unexpected {frame.kind.name} frame on the progress channel")
        except (ProtocolError, ValueError) as exc:
            if not self._listener.stopping and not isinstance(exc, ConnectionClosed):
                log.warning("progress channel refused %s: %s", peer, exc)
        except OSError:
            pass  # the worker finished, or stop() closed the socket
        finally:
            close_quietly(sock)


class ProgressReporter:
    """A worker's side: rate-limited reports, log records, never an exception.

    Args:
        endpoint: the driver's progress channel.
        rank: this worker's rank.
        attempt: the stage attempt.
        clock: monotonic clock (patched in tests).
    """

    def __init__(
        self, endpoint: ProgressEndpoint, rank: int, attempt: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rank = rank
        self.attempt = attempt
        self._interval = endpoint.interval_s
        self._clock = clock
        self._last = -float("inf")
        self._lock = threading.Lock()  # log records may come from other threads
        self._channel: Channel | None = None
        try:
            sock = socket.create_connection((endpoint.host, endpoint.port), timeout=10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            channel = client_hello(sock, endpoint.secret, rank, attempt)
            if channel.recv(_MAX_PAYLOAD).kind is Kind.ACK:
                sock.settimeout(10)
                self._channel = channel
        except (OSError, ProtocolError) as exc:
            log.warning("rank %d: no progress reports, the driver is not reachable: %s", rank, exc)

    def due(self) -> bool:
        """Whether ``interval_s`` has passed since the last report (cheap: call every step)."""
        return self._channel is not None and self._clock() - self._last >= self._interval

    def send(self, report: Report) -> None:
        self._last = self._clock()
        frame = Frame(
            Kind.PROGRESS,
            shard=report.epoch,
            rank=self.rank,
            attempt=self.attempt,
            clock=report.steps,
            payload=report.pack(),
        )
        self._send(frame)

    def log(self, level: int, message: str) -> None:
        if self._channel is not None:
            payload = message[:_MAX_LOG_CHARS].encode()
            self._send(Frame(Kind.LOG, shard=level, rank=self.rank, attempt=self.attempt, payload=payload))

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                close_quietly(self._channel.sock)
                self._channel = None

    def _send(self, frame: Frame) -> None:
        with self._lock:
            if self._channel is None:
                return
            try:
                self._channel.send(frame)
            except OSError as exc:  # the driver went away: train on, silently
                log.info("rank %d: progress channel closed: %s", self.rank, exc)
                close_quietly(self._channel.sock)
                self._channel = None


class ForwardToDriver(logging.Handler):
    """Sends this worker's WARNING and ERROR records to the driver, where they are
    logged again as ``sparkdl.worker`` with the rank."""

    def __init__(self, reporter: ProgressReporter, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.reporter = reporter

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("sparkdl.progress"):
            return  # never report on the reporter itself
        try:
            self.reporter.log(record.levelno, f"{record.name}: {self.format(record)}")
        except Exception:  # a log handler must never raise
            self.handleError(record)


@contextlib.contextmanager
def reporting_to_driver(
    endpoint: ProgressEndpoint | None, rank: int, attempt: int
) -> Iterator[ProgressReporter | None]:
    """For the length of a worker's task: a reporter to the driver (None without an
    endpoint), with this process's warnings and errors forwarded to the driver's log,
    and the task's own error sent there before it propagates."""
    if endpoint is None:
        yield None
        return
    reporter = ProgressReporter(endpoint, rank, attempt)
    forward = ForwardToDriver(reporter)
    root = logging.getLogger()
    root.addHandler(forward)
    logging.captureWarnings(True)
    try:
        yield reporter
    except Exception as exc:
        reporter.log(logging.ERROR, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        logging.captureWarnings(False)
        root.removeHandler(forward)
        reporter.close()
