"""The driver-side progress channel: workers report over an authenticated socket.

The driver listens on its own address (port chosen by the OS) for the length of one
``fit``; each worker opens one connection, says HELLO under the fit's secret (the
progress protocol, :mod:`sparkdl.services.progress.protocol`, on the shared framing of
:mod:`sparkdl.wire`), then sends REPORT frames at most every ``progress_interval_s``,
LOG frames for its warnings and errors and, when asked to, a HEARTBEAT whenever it
sent nothing else for ``heartbeat_s``; a GOODBYE ends its session. Nothing is answered
after the HELLO's ACK, so a worker never waits on the driver; if the driver cannot be
reached, the worker trains on without reports. The driver keeps when it last heard from
each rank of the newest stage attempt (:meth:`ProgressServer.silence`); a rank leaves it
only by its GOODBYE, which is authenticated as every frame is: a connection that just
ends (EOF, a reset, one an attacker on the network cut) leaves the rank's silence
counting, so the stall watchdog still sees a worker that vanished.

What a worker can make the driver do is bounded: a connection is bound at its HELLO to
one rank and stage attempt (a frame claiming another closes it), a newer attempt is only
believed when Spark started it (``attempt_started``), the board takes reports of the
fit's own ranks and epochs only, and a worker's log record is escaped to one line and
cut to :data:`MAX_LOG_CHARS` on the driver, whatever the worker sent; a rank's records are
logged at most :data:`~sparkdl.services.worker_lines.BURST` at once, then
:data:`~sparkdl.services.worker_lines.PER_S` a second, the others dropped and counted.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass

from sparkdl.errors import ConfigError, ConnectionClosed, ProtocolError
from sparkdl.services.progress.board import ProgressBoard, Report
from sparkdl.services.progress.protocol import (
    MAX_LOG_CHARS,
    MAX_PAYLOAD,
    PROGRESS_WIRE,
    Ack,
    Goodbye,
    Heartbeat,
    Hello,
    Log,
    Message,
    ProgressChannel,
    client_hello,
)
from sparkdl.services.worker_lines import WorkerLines
from sparkdl.wire.handshake import with_retries
from sparkdl.wire.listener import ConnectionListener
from sparkdl.wire.refusals import close_quietly, one_line

log = logging.getLogger(__name__)
worker_log = logging.getLogger("sparkdl.worker")

_JOIN_S = 15.0  # a heartbeat blocked in a send gives up after the socket's 10 s timeout


@dataclass(frozen=True)
class ProgressEndpoint:
    """Where workers report; shipped inside the task spec."""

    host: str
    port: int
    secret: bytes
    server_key: bytes  # the server's static public key (the handshake proves the driver)
    interval_s: float
    encrypt: bool = False

    def __repr__(self) -> str:  # never print the secret
        return f"ProgressEndpoint({self.host}:{self.port})"


class ProgressServer:
    """Receives reports, heartbeats and worker log records on the driver until :meth:`stop`.

    Args:
        board: where reports go.
        host: address to bind (the driver's address that executors reach).
        secret: the per-fit secret.
        interval_s: how often workers report (shipped to them in the endpoint).
        clock: monotonic clock for :meth:`silence` (patched in tests).
        encrypt: encrypt every frame (``runtime.encrypt``).
        attempt_started: whether Spark really started the stage attempt a HELLO claims
            (None believes any: for servers outside a Spark driver).
        known: the executors' addresses (places are reserved for them; None: none known).
    """

    def __init__(
        self,
        board: ProgressBoard,
        host: str,
        secret: bytes,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        encrypt: bool = False,
        attempt_started: Callable[[int], bool] | None = None,
        known: Container[str] | None = None,
    ) -> None:
        self.board = board
        self._secret = secret
        self._interval_s = interval_s
        self._clock = clock
        self._encrypt = encrypt
        self._attempt_started = attempt_started
        self._heard_lock = threading.Lock()
        self._attempt = -1  # the newest stage attempt that said HELLO
        self._last_heard: dict[int, float] = {}  # rank -> clock of its last frame, in that attempt
        self._lines = WorkerLines(board.num_workers, worker_log, "log records", clock=clock)
        self._listener = ConnectionListener(
            host,
            PROGRESS_WIRE,
            secret,
            self._serve,
            "sparkdl-progress",
            log,
            encrypt=encrypt,
            max_sessions=2 * board.num_workers + 16,
            known=known,
        )
        self.host, self.port, self.public_key = (
            self._listener.host,
            self._listener.port,
            self._listener.public_key,
        )

    @property
    def refusals(self) -> dict[str, int]:
        """Refused connections and frames by reason."""
        return dict(self._listener.refusals.counts)

    def endpoint(self) -> ProgressEndpoint:
        return ProgressEndpoint(
            self.host, self.port, self._secret, self.public_key, self._interval_s, self._encrypt
        )

    def silence(self) -> dict[int, float]:
        """Seconds since the last frame (of any kind) of each rank that said HELLO in the
        newest stage attempt; ranks of older attempts are forgotten when a newer one connects."""
        now = self._clock()
        with self._heard_lock:
            return {rank: now - last for rank, last in sorted(self._last_heard.items())}

    def stop(self, timeout: float = 5.0, drain_s: float = 2.0) -> None:
        """Close the port; let each connection read what its worker sent before it closed
        (up to ``drain_s``: the tasks are over, their sockets at EOF), then close every
        connection, join the threads (bounded) and close the bar."""
        self._listener.stop(timeout, drain_s)
        self._lines.flush()
        self.board.close()

    def _serve(self, hello: Message, channel: ProgressChannel, peer: tuple[str, int]) -> None:
        assert isinstance(hello, Hello)  # the framing checked the kind
        try:
            if not 0 <= hello.rank < self.board.num_workers:
                raise ProtocolError(
                    f"a HELLO of rank {hello.rank}; this fit has {self.board.num_workers} workers"
                )
            if self._attempt_started is not None and hello.attempt > self._attempt:
                if not self._attempt_started(hello.attempt):
                    raise ProtocolError(f"a HELLO of stage attempt {hello.attempt}, which Spark does not run")
            self._heard(hello.rank, hello.attempt)
            channel.send(Ack(hello.rank, hello.attempt))
            self.board.worker_started(hello.rank, hello.attempt)
            while not self._receive(hello, channel.recv(MAX_PAYLOAD)):
                pass  # until the worker's GOODBYE, its connection's end or stop()
            self._forget(hello.rank, hello.attempt)  # the worker is done: its silence means nothing now
        except ConnectionClosed:
            if not self._listener.stopping:  # no GOODBYE: the rank's silence keeps counting
                log.info(
                    "rank %d (stage attempt %d): its progress connection ended without a goodbye; "
                    "the stall watchdog keeps counting its silence",
                    hello.rank,
                    hello.attempt,
                )
        except ProtocolError as exc:
            if not self._listener.stopping:
                self._listener.refusals.add("frame refused", peer, str(exc))
        except OSError:
            pass  # the worker finished, or stop() closed the socket

    def _receive(self, hello: Hello, message: Message) -> bool:
        """Apply one frame from the worker that said ``hello`` on this connection; True when it
        was the worker's GOODBYE."""
        if (message.rank, message.attempt) != (hello.rank, hello.attempt):
            raise ProtocolError(
                f"a frame of rank {message.rank} attempt {message.attempt} on the connection of "
                f"rank {hello.rank} attempt {hello.attempt}"
            )
        self._heard(hello.rank, hello.attempt)
        if isinstance(message, Report):
            if not 1 <= message.epoch <= self.board.epochs:
                raise ProtocolError(
                    f"a report of epoch {message.epoch}; this fit has {self.board.epochs} epochs"
                )
            self.board.update(message)
        elif isinstance(message, Log):
            if self._lines.admit(message.rank):
                level = (
                    message.level if logging.DEBUG <= message.level <= logging.CRITICAL else logging.WARNING
                )
                worker_log.log(level, "[rank %d] %s", message.rank, one_line(message.text, MAX_LOG_CHARS))
        elif isinstance(message, Goodbye):
            return True
        elif not isinstance(message, Heartbeat):
            raise ProtocolError(f"unexpected {type(message).__name__} from a worker on the progress channel")
        return False

    def _forget(self, rank: int, attempt: int) -> None:
        with self._heard_lock:
            if attempt == self._attempt:
                self._last_heard.pop(rank, None)

    def _heard(self, rank: int, attempt: int) -> None:
        now = self._clock()
        with self._heard_lock:
            if attempt > self._attempt:  # a re-run stage: the failed attempt's ranks are gone
                self._attempt, self._last_heard = attempt, {}
            if attempt == self._attempt:
                self._last_heard[rank] = now


class ProgressReporter:
    """A worker's side: rate-limited reports, log records, heartbeats, never an exception.

    Args:
        endpoint: the driver's progress channel.
        rank: this worker's rank.
        attempt: the stage attempt.
        clock: monotonic clock of the report rate limit (patched in tests).
        heartbeat_s: when set, a daemon thread sends a HEARTBEAT whenever this many
            seconds passed without any other frame; :meth:`close` stops it.

    Raises:
        ConfigError: ``heartbeat_s`` is not a positive number of seconds.
    """

    def __init__(
        self,
        endpoint: ProgressEndpoint,
        rank: int,
        attempt: int,
        clock: Callable[[], float] = time.monotonic,
        heartbeat_s: float | None = None,
    ) -> None:
        if heartbeat_s is not None and not heartbeat_s > 0:
            raise ConfigError(f"heartbeat_s must be a positive number of seconds, got {heartbeat_s!r}")
        self.rank = rank
        self.attempt = attempt
        self._interval = endpoint.interval_s
        self._clock = clock
        self._last = -float("inf")
        self._last_sent = time.monotonic()  # of any frame: heartbeats fill the gaps
        self._lock = threading.Lock()  # log records and heartbeats come from other threads
        self._stopping = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._channel = self._connect(endpoint)
        if self._channel is not None and heartbeat_s is not None:
            self._heartbeat = threading.Thread(
                target=self._beat, args=(heartbeat_s,), name=f"sparkdl-progress-heartbeat-{rank}", daemon=True
            )
            self._heartbeat.start()

    def _connect(self, endpoint: ProgressEndpoint) -> ProgressChannel | None:
        """The channel to the driver after its ACK, or None (logged) when it cannot be reached;
        a handshake the driver closed before answering (a flood at its port) is tried again."""
        try:
            channel = with_retries(lambda: self._open(endpoint), f"rank {self.rank}: progress channel")
        except (OSError, ProtocolError) as exc:
            log.warning("rank %d: no progress reports, the driver refused the channel: %s", self.rank, exc)
            return None
        self._last_sent = time.monotonic()
        return channel

    def _open(self, endpoint: ProgressEndpoint) -> ProgressChannel:
        sock = socket.create_connection((endpoint.host, endpoint.port), timeout=10)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            channel = client_hello(
                sock,
                endpoint.secret,
                self.rank,
                self.attempt,
                endpoint.encrypt,
                server_key=endpoint.server_key,
            )
            if isinstance(channel.recv(MAX_PAYLOAD), Ack):
                return channel
            raise ProtocolError("the driver answered the HELLO with something other than an ACK")
        except BaseException:
            close_quietly(sock)
            raise

    def due(self) -> bool:
        """Whether ``interval_s`` has passed since the last report (cheap: call every step)."""
        return self._channel is not None and self._clock() - self._last >= self._interval

    def send(self, report: Report) -> None:
        """Send this worker's figures for the running epoch (rank and attempt must be its own)."""
        self._last = self._clock()
        self._send(report)

    def log(self, level: int, message: str) -> bool:
        """Send a log record; the driver logs it again as ``sparkdl.worker`` with the rank.

        Returns:
            whether it was sent (False: no channel to the driver, which will not see it).
        """
        return self._send(Log(self.rank, self.attempt, level, message[:MAX_LOG_CHARS]))

    def close(self) -> None:
        """Stop and join the heartbeat thread (bounded), say GOODBYE (the driver stops
        counting this rank's silence), then close the connection."""
        self._stopping.set()
        if self._heartbeat is not None:
            self._heartbeat.join(_JOIN_S)
            self._heartbeat = None
        self._send(Goodbye(self.rank, self.attempt))
        with self._lock:
            if self._channel is not None:
                close_quietly(self._channel.sock)
                self._channel = None

    def _beat(self, every: float) -> None:
        """Runs on the heartbeat thread: a HEARTBEAT whenever ``every`` seconds passed
        without a frame, until :meth:`close` or the driver goes away."""
        wait = every
        while not self._stopping.wait(wait) and self._channel is not None:
            idle = time.monotonic() - self._last_sent
            if idle >= every:
                self._send(Heartbeat(self.rank, self.attempt))
                wait = every
            else:
                wait = every - idle

    def _send(self, message: Message) -> bool:
        """Send ``message``; whether it went (False: no channel, or it just closed)."""
        with self._lock:
            if self._channel is None:
                return False
            try:
                self._channel.send(message)
                self._last_sent = time.monotonic()
                return True
            except OSError as exc:  # the driver went away: train on, silently
                log.info("rank %d: progress channel closed: %s", self.rank, exc)
                close_quietly(self._channel.sock)
                self._channel = None
                return False


class ForwardToDriver(logging.Handler):
    """Sends this worker's WARNING and ERROR records to the driver, where they are
    logged again as ``sparkdl.worker`` with the rank."""

    def __init__(self, reporter: ProgressReporter, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.reporter = reporter

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("sparkdl.services.progress"):
            return  # never report on the reporter itself
        try:
            self.reporter.log(record.levelno, f"{record.name}: {self.format(record)}")
        except Exception:  # a log handler must never raise
            self.handleError(record)


class HeldRecords(logging.Handler):
    """Keeps this worker's WARNING and ERROR records from before its reporter could start
    (the reporter needs the stage attempt, known once the ranks have met), to send them
    when it does: at most ``limit``, the later ones counted."""

    def __init__(self, limit: int = 100) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self.dropped = 0
        self._limit = limit

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < self._limit:
            self.records.append(record)
        else:
            self.dropped += 1

    def __enter__(self) -> HeldRecords:
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *_: object) -> None:
        logging.getLogger().removeHandler(self)

    def send_to(self, reporter: ProgressReporter | None) -> None:
        """Stop holding; send what was held through ``reporter`` (nothing without one)."""
        self.__exit__()
        if reporter is None:
            return
        forward = ForwardToDriver(reporter)
        for record in self.records:
            forward.handle(record)
        if self.dropped:
            reporter.log(logging.WARNING, f"{self.dropped} more warnings before the reporter started")
        self.records.clear()


@contextlib.contextmanager
def reporting_to_driver(
    endpoint: ProgressEndpoint | None, rank: int, attempt: int, *, heartbeat_s: float | None = None
) -> Iterator[ProgressReporter | None]:
    """For the length of a worker's task: a reporter to the driver (None without an
    endpoint), with this process's warnings and errors forwarded to the driver's log,
    and the task's own error sent there before it propagates.

    Args:
        endpoint: the driver's progress channel, or None when it does not listen.
        rank: this worker's rank.
        attempt: the stage attempt.
        heartbeat_s: send a HEARTBEAT whenever the worker said nothing for this long
            (None: no heartbeats).
    """
    if endpoint is None:
        yield None
        return
    reporter = ProgressReporter(endpoint, rank, attempt, heartbeat_s=heartbeat_s)
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
