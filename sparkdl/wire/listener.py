"""A listening socket on the driver that authenticates before it spends anything on a peer.

All four driver-side servers use it: the meeting point (:mod:`sparkdl.services.meeting.server`),
the parameter server (:mod:`sparkdl.services.ps.server`), the progress channel
(:mod:`sparkdl.services.progress.channel`) and the weights server
(:mod:`sparkdl.services.weights.server`). Their port is reachable by anyone on the cluster network,
so until a peer has proved it holds the secret it gets, from here:

- one file descriptor and a ~100-byte buffer, in one thread (a selector) shared by every
  connection still in its handshake: no thread, no allocation it chooses;
- ``hello_timeout_s`` to send its HELLO, counted from the accept, not per read;
- a place among at most ``max_pending`` such connections, at most half of them from one
  address: when they are full, a newcomer evicts a connection of the address holding the
  most (its own, when that is the flooder's): the oldest that sent nothing a HELLO starts
  with, else, among those past :data:`GRACE_S` since their accept, the one whose HELLO has
  come least far (then the oldest). A connection younger than that is never evicted: a
  worker's whole HELLO follows the challenge within a round trip, so a worker is in before
  its grace ends, while a peer that sends a HELLO's first bytes and stalls (which used to
  hold its place, unevictable, until its timeout) is evicted by the next newcomer. Where
  every place is young the newcomer is turned away (its client retries, over a window
  longer than the HELLO timeout); before that it evicts from the other addresses, the most
  first, where its own has room. So a flood from one address evicts its own connections,
  never a worker's from another, and no pattern of stalled HELLOs keeps workers out;
- a quarter of the places reserved for the addresses the workers connect from (``known``:
  the executors' hosts Spark knows): a connection from any other address evicts only
  others' and is turned away once they hold the other three quarters, so that not even a
  flood from many addresses whose connections are renewed faster than the grace (every
  place young, none evictable) keeps the workers out;
- no log line of its own: refusals are counted by reason, the first of each reason logged,
  then one line per reason and ``every_s`` with the count (:class:`Refusals`).

The accept loop survives running out of file descriptors (it evicts the oldest pending
connection and goes on) and any other failed accept. An authenticated connection gets a
thread running ``serve(hello, channel, peer)``, at most ``max_sessions`` at once; the
thread's end removes it. :meth:`ConnectionListener.stop` closes everything in bounded time.
"""

from __future__ import annotations

import collections
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from sparkdl.errors import ProtocolError
from sparkdl.wire.framing import (
    HELLO_PAYLOAD_BYTES,
    MAGIC,
    PREFIX,
    VERSION,
    Challenge,
    Channel,
    SecretLookup,
    ServerKey,
    WireProtocol,
    accept_hello,
    server_challenge,
)
from sparkdl.wire.refusals import Refusals, close_quietly, keep_alive
from sparkdl.wire.socket_io import BUSY

M = TypeVar("M")

Serve = Callable[[M, Channel[M], tuple[str, int]], None]

_WAKE = object()  # the selector key of the loop's wake-up socket
_POLL_S = 0.2  # how often the loop looks at stop() and at expired handshakes, at most
_ACCEPT_BATCH = 64  # accepts per wake-up, so that reading HELLOs is never starved
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_BACKOFF_S = 0.05  # an accept failed and nothing could be freed: wait this long
#: A pending connection this young is never evicted: time for a worker's HELLO to follow the
#: challenge (one round trip, and a busy executor's scheduling) before newcomers may take its place.
GRACE_S = 0.5


def hello_prefix(protocol: WireProtocol) -> bytes:
    """The bytes every HELLO of ``protocol`` starts with: its header's fixed prefix."""
    return PREFIX.pack(MAGIC, VERSION, protocol.ident, protocol.hello_kind, HELLO_PAYLOAD_BYTES)


def turn_away(sock: socket.socket) -> None:
    """Tell a handshake it was turned away for want of room (:data:`BUSY`: its client tries
    again), and close it; best effort, never blocking."""
    try:
        sock.send(BUSY)
    except OSError:
        pass
    close_quietly(sock)


@dataclass(eq=False)
class _Pending:
    """A connection in its handshake: the challenge sent, the HELLO's bytes so far."""

    sock: socket.socket
    peer: tuple[str, int]
    challenge: Challenge
    deadline: float
    hello: bytearray
    accepted: float
    known: bool
    received: int = 0


@dataclass(eq=False)
class _Session:
    sock: socket.socket
    thread: threading.Thread = field(init=False)


class ConnectionListener(Generic[M]):
    """Listens on ``(host, port 0)``; runs ``serve(hello, channel, peer)`` in a thread for
    each connection that completed the handshake of ``protocol`` under ``secret``.

    ``serve`` may leave its socket open: the listener closes it when ``serve`` returns,
    and :meth:`stop` closes whatever is still open. Its static key (the handshake's proof
    that a client reached this server) is made here; clients need :attr:`public_key`.

    Args:
        host: the address to bind.
        protocol: the protocol spoken (its HELLO is read and verified here).
        secret: the per-fit secret, or a lookup from a HELLO's fields to its resource's.
        serve: the session, on its own thread, once the peer is authenticated.
        name: names the threads and the log lines.
        logger: where refusals are logged.
        encrypt: every connection's payloads (and header fields) are encrypted.
        hello_timeout_s: the time from accept to a complete HELLO.
        max_pending: connections in their handshake at once (at most half of them from one
            address; see the module's docstring for whom a newcomer evicts).
        max_sessions: authenticated connections at once (one more is refused).
        known: the addresses the workers connect from (the executors' hosts Spark knows, a
            live view): a quarter of the pending places is theirs alone, so that no flood
            from other addresses, however fast it renews its connections, fills every
            place. None: every address alike.
    """

    def __init__(
        self,
        host: str,
        protocol: WireProtocol[M],
        secret: bytes | SecretLookup,
        serve: Serve,
        name: str,
        logger: logging.Logger,
        *,
        encrypt: bool = False,
        hello_timeout_s: float = 5.0,
        max_pending: int = 128,
        max_sessions: int = 256,
        known: Container[str] | None = None,
    ) -> None:
        self._protocol = protocol
        self._known = known
        # places only the known addresses may take (none where no address is known)
        self._reserved = max_pending // 4 if known is not None else 0
        self._strangers = 0  # pending connections from addresses not known
        self._secret = secret
        self._serve = serve
        self._name = name
        self._encrypt = encrypt
        self._key = ServerKey()  # this listener's static key: its public half goes in the tasks
        self.public_key = self._key.public
        self._hello_timeout_s = hello_timeout_s
        self._max_pending = max_pending
        self._max_sessions = max_sessions
        self.refusals = Refusals(name, logger)
        self._socket = socket.create_server((host, 0), backlog=128)
        self._socket.setblocking(False)
        self.host, self.port = host, self._socket.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._socket, selectors.EVENT_READ, None)
        # stop() writes a byte here, so the loop ends now, not at its next poll
        self._wake, self._waker = socket.socketpair()
        self._wake.setblocking(False)
        self._selector.register(self._wake, selectors.EVENT_READ, _WAKE)
        self._accepting = True
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._per_address: collections.Counter[str] = collections.Counter()  # pending, by address
        self._max_per_address = max(1, max_pending // 2)
        self._hello_prefix = hello_prefix(protocol)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._sessions: list[_Session] = []
        self._loop = threading.Thread(target=self._run, name=f"{name}-accept", daemon=True)
        self._loop.start()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called: a connection's end is then expected, not an error."""
        return self._stopping.is_set()

    @property
    def sessions(self) -> int:
        """Authenticated connections open now."""
        with self._lock:
            return len(self._sessions)

    @property
    def pending(self) -> int:
        """Connections in their handshake now (read by tests; approximate while it runs)."""
        return len(self._pending)

    def stop(self, timeout: float = 10.0, drain_s: float = 0.0) -> None:
        """Close the port and every pending handshake; give sessions up to ``drain_s`` to
        finish by themselves (their peers are done and at EOF), then close them and join
        every thread (bounded)."""
        self._stopping.set()
        try:
            self._waker.send(b"\0")
        except OSError:  # stopped before (the loop closed its end)
            pass
        self._loop.join(timeout)
        self._waker.close()
        with self._lock:
            sessions = list(self._sessions)
        deadline = time.monotonic() + drain_s
        for session in sessions:
            session.thread.join(max(deadline - time.monotonic(), 0.0))
        for session in sessions:
            close_quietly(session.sock)
        for session in sessions:
            session.thread.join(timeout)
        self.refusals.flush()

    # --- the handshake loop (one thread) ---------------------------------------------

    def _run(self) -> None:
        resume_at = 0.0
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                self._expire(now)
                if not self._accepting and now >= resume_at:
                    self._selector.register(self._socket, selectors.EVENT_READ, None)
                    self._accepting = True
                wait = _POLL_S
                if self._pending:
                    wait = min(wait, max(next(iter(self._pending.values())).deadline - now, 0.0))
                for key, _ in self._selector.select(wait):
                    if key.data is _WAKE:
                        break
                    if key.data is None:
                        if not self._accept_safely():
                            self._selector.unregister(self._socket)
                            self._accepting, resume_at = False, time.monotonic() + _BACKOFF_S
                    elif key.data.sock in self._pending:  # not evicted earlier in this batch
                        self._read_safely(key.data)
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending)
            self._selector.close()
            self._socket.close()
            self._wake.close()

    def _accept_safely(self) -> bool:
        """:meth:`_accept_some`, whose unexpected failure pauses accepting, never the loop."""
        try:
            return self._accept_some()
        except Exception as exc:
            self.refusals.add("accept failed", "a new connection", f"{type(exc).__name__}: {exc}")
            return False

    def _read_safely(self, pending: _Pending) -> None:
        """:meth:`_read_hello`, whose unexpected failure costs that connection, never the loop."""
        try:
            self._read_hello(pending)
        except Exception as exc:
            self.refusals.add("handshake failed", pending.peer, f"{type(exc).__name__}: {exc}")
            self._drop(pending)
            close_quietly(pending.sock)

    def _accept_some(self) -> bool:
        """Accept what is waiting (a batch at most); False when accepting must pause."""
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, peer = self._socket.accept()
            except BlockingIOError:
                return True
            except OSError as exc:
                if self._stopping.is_set():
                    return True
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    self.refusals.add(
                        "accept failed for lack of file descriptors",
                        "a new connection",
                        f"{exc}; the oldest pending handshake was closed to make room"
                        if self._pending
                        else f"{exc}; raise the open-files limit (ulimit -n) of the driver",
                    )
                    if not self._pending:
                        return False
                    victim = self._idlest(self._per_address.most_common(1)[0][0])
                    self._drop(victim or next(iter(self._pending.values())))
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    continue
                self.refusals.add("accept failed", "a new connection", str(exc))
                return False
            self._admit(sock, peer)
        return True

    def _admit(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        known = self._is_known(peer[0])
        challenge = server_challenge(self._protocol, self._key, self._encrypt)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._make_room(peer, known):
                turn_away(sock)
                return
            if sock.send(challenge.data) != len(challenge.data):  # a fresh socket's buffer takes its 88 bytes
                raise OSError("the challenge did not fit the socket's buffer")
        except OSError:
            close_quietly(sock)
            return
        now = time.monotonic()
        pending = _Pending(
            sock,
            peer,
            challenge,
            now + self._hello_timeout_s,
            bytearray(self._protocol.hello_size),
            now,
            known,
        )
        self._pending[sock] = pending
        self._per_address[peer[0]] += 1
        self._strangers += not known
        self._selector.register(sock, selectors.EVENT_READ, pending)

    def _make_room(self, peer: tuple[str, int], known: bool) -> bool:
        """Whether a connection from ``peer`` (``known``: from an executor's address) may wait
        for its HELLO, after evicting another where the pending are full, of the address
        holding the most (``peer``'s own when it holds as many, or has half the places
        already): see :meth:`_victim`."""
        address = peer[0]
        own = self._per_address[address] + 1  # with the newcomer
        room = known or self._strangers < self._max_pending - self._reserved
        if own <= self._max_per_address and len(self._pending) < self._max_pending and room:
            return True
        # a stranger evicts only strangers (the reserved places stay the known addresses'); a
        # known newcomer evicts strangers first
        ranked = self._per_address.most_common()
        rivals = [(a, n) for a, n in ranked if not self._is_known(a)]
        rivals += [(a, n) for a, n in ranked if known and self._is_known(a)]
        top, held = rivals[0] if rivals else (address, 0)
        source = address if own > self._max_per_address or own >= held else top
        now = time.monotonic()
        victim = self._victim(source, now)
        if victim is None and own <= self._max_per_address:  # the others', the most first
            for other, _ in rivals:
                victim = self._victim(other, now) if other != source else None
                if victim is not None:
                    break
        if victim is None:  # every one it may evict is within its grace: the newcomer tries again
            self.refusals.add(
                f"refused: {self._max_pending} connections were waiting for their HELLO, "
                f"each accepted less than {GRACE_S:g} s ago",
                peer,
                f"{self._per_address[source]} of them from {source}",
            )
            return False
        self.refusals.add(
            f"evicted: {self._max_pending} connections were waiting for their HELLO",
            victim.peer,
            f"{self._per_address[source]} of them from {source}",
        )
        self._drop(victim, close=False)
        turn_away(victim.sock)
        return True

    def _is_known(self, address: str) -> bool:
        return self._known is not None and address in self._known

    def _idlest(self, address: str) -> _Pending | None:
        """``address``'s oldest pending connection that has not begun a HELLO of this
        protocol (nothing sent, or bytes no HELLO starts with)."""
        return next((p for p in self._pending.values() if p.peer[0] == address and not self._begun(p)), None)

    def _victim(self, address: str, now: float) -> _Pending | None:
        """Whom a newcomer evicts among ``address``'s pending connections past their grace
        (:data:`GRACE_S` since the accept): the oldest that sent nothing a HELLO starts with,
        else the one whose HELLO has come least far, the oldest of those; None where all of
        them are within their grace."""
        aged = [p for p in self._pending.values() if p.peer[0] == address and now - p.accepted >= GRACE_S]
        idle = next((p for p in aged if not self._begun(p)), None)
        if idle is not None:
            return idle
        return min(aged, key=lambda p: (p.received, p.accepted), default=None)

    def _begun(self, pending: _Pending) -> bool:
        """Whether ``pending`` has sent the first bytes of a HELLO of this protocol, as far as
        they go (its header's prefix is fixed: magic, version, protocol, kind, length)."""
        n = min(pending.received, len(self._hello_prefix))
        return n > 0 and pending.hello[:n] == self._hello_prefix[:n]

    def _read_hello(self, pending: _Pending) -> None:
        try:
            n = pending.sock.recv_into(memoryview(pending.hello)[pending.received :])
        except BlockingIOError:
            return
        except OSError:
            n = 0
        if n == 0:
            self.refusals.add("closed before its HELLO", pending.peer)
            self._drop(pending)
            return
        pending.received += n
        if pending.received < len(pending.hello):
            return
        self._drop(pending, close=False)
        try:
            hello, channel = accept_hello(
                pending.sock, pending.hello, pending.challenge, self._secret, self._protocol
            )
        except ProtocolError as exc:
            self.refusals.add("HELLO refused", pending.peer, str(exc))
            close_quietly(pending.sock)
            return
        self._start_session(hello, channel, pending.peer)

    def _start_session(self, hello: M, channel: Channel[M], peer: tuple[str, int]) -> None:
        with self._lock:
            full = len(self._sessions) >= self._max_sessions
            if not full:
                session = _Session(channel.sock)
                session.thread = threading.Thread(
                    target=self._run_session,
                    args=(session, hello, channel, peer),
                    name=f"{self._name}-{peer[1]}",
                    daemon=True,
                )
                self._sessions.append(session)
        if full:
            self.refusals.add(f"over the cap of {self._max_sessions} open sessions", peer)
            close_quietly(channel.sock)
            return
        channel.sock.setblocking(True)
        keep_alive(channel.sock)  # a dead peer's session ends, though no FIN ever comes
        session.thread.start()

    def _run_session(self, session: _Session, hello: M, channel: Channel[M], peer: tuple[str, int]) -> None:
        try:
            self._serve(hello, channel, peer)
        finally:
            close_quietly(session.sock)
            with self._lock:
                self._sessions.remove(session)

    def _expire(self, now: float) -> None:
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                return
            self.refusals.add(f"no HELLO within {self._hello_timeout_s:g} s", oldest.peer)
            self._drop(oldest)

    def _drop(self, pending: _Pending, close: bool = True) -> None:
        """Forget a pending handshake (and close its socket unless told not to); forgetting
        one already forgotten does nothing."""
        if self._pending.pop(pending.sock, None) is None:
            return
        self._strangers -= not pending.known
        self._per_address[pending.peer[0]] -= 1
        if not self._per_address[pending.peer[0]]:
            del self._per_address[pending.peer[0]]
        self._selector.unregister(pending.sock)
        if close:
            close_quietly(pending.sock)
