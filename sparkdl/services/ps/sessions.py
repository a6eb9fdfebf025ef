"""One worker connection of the parameter server, on its own thread, from its HELLO to its end.

Every connection must open with an authenticated HELLO (the listener's handshake,
:mod:`sparkdl.wire.listener`); it binds the connection to one rank and one stage attempt,
and a frame claiming another closes it. A frame that fails authentication, is truncated,
or announces more than the largest shard closes that connection (logged with the peer's
address, rate-limited); the other workers are not affected. A HELLO whose stage attempt
is refused is answered with an ERROR frame and the connection ends.

Requests are answered in order, one at a time (:class:`RequestHandler`), each before the
next frame is read, so the connection's buffers are reused (:class:`WarmBuffers`). The
PULL that ``push_pull`` sends right behind its PUSH is answered together with it, in one
``sendmsg``.

Who sends on the channel: this connection's thread, except while its pull is parked
(:mod:`sparkdl.services.ps.parking`): then the thread that answers the pull sends that
answer, under the shard's parked lock. Meanwhile this thread sleeps on the socket until
the worker's next request (or answers the pull itself at its deadline), reads that
request, and waits for the lock before it answers it: one thread at a time sends.
"""

from __future__ import annotations

import threading
import time

from sparkdl.comm.ps_areas import ServerAreas
from sparkdl.errors import CheckpointError, ConnectionClosed, ProtocolError, PushRejected
from sparkdl.services.ps.connection import WarmBuffers
from sparkdl.services.ps.handling import RequestHandler
from sparkdl.services.ps.protocol import Frame, Kind, PsChannel, error_frame
from sparkdl.services.ps.served_attempt import StageAttempts
from sparkdl.wire.listener import ConnectionListener


class Sessions:
    """Serves worker connections, each on the thread the listener gives it.

    Args:
        requests: answers each request.
        attempts: the stage attempt a HELLO joins.
        areas: the server's shared memory (None: payloads travel in the frames).
        listener: the connections' listener (whether it stops; where refusals are counted).
        frame_cap: the largest frame payload accepted, in bytes.
    """

    def __init__(
        self,
        requests: RequestHandler,
        attempts: StageAttempts,
        areas: ServerAreas | None,
        listener: ConnectionListener[Frame],
        frame_cap: int,
    ) -> None:
        self._requests = requests
        self._parked = requests.parked
        self._attempts = attempts
        self._areas = areas
        self._listener = listener
        self._frame_cap = frame_cap
        self._answering = 0  # requests read and not yet answered, over every connection
        self._answered = threading.Condition()

    def wait_answered(self, timeout_s: float) -> bool:
        """Wait until no request is being answered (at most ``timeout_s``): stopping the
        server first wakes the pulls that wait, then lets them send the worker why, before
        it closes their connections. False if one was still being answered."""
        deadline = time.monotonic() + timeout_s
        with self._answered:
            while self._answering:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._answered.wait(remaining)
        return True

    def serve(self, hello: Frame, channel: PsChannel, peer: tuple[str, int]) -> None:
        """Serve one authenticated connection until it ends or the server stops."""
        warm = WarmBuffers()  # this connection's pushes and pulled weights, reused
        task = -1  # independent tasks: the partition of this connection, once begun
        try:
            rows = 0
            try:
                if self._attempts.independent:  # an independent task: its partition, its attempt
                    rows = self._attempts.begin_task(hello.rank, hello.attempt)
                    task = hello.rank
                else:
                    self._attempts.begin(hello.attempt, hello.clock, hello.rows)
            except (PushRejected, CheckpointError) as exc:
                channel.send(error_frame(exc))
                self._requests.reject(peer, str(exc))
                return
            if hello.area and self._areas is not None:
                warm.area = self._areas.acquire()
            ack = Frame(Kind.ACK, rows=rows, area=0 if warm.area is None else warm.area + 1)
            channel.send(ack)
            while not self._listener.stopping:
                self._serve_next(channel, hello, warm)
        except ProtocolError as exc:
            if not self._listener.stopping and not isinstance(exc, ConnectionClosed):
                self._listener.refusals.add("frame refused", peer, str(exc))
        except OSError:
            pass  # the worker went away, or stop() closed the socket
        finally:
            if task >= 0:
                self._attempts.end_task_connection(task, hello.attempt)
            if warm.waiting is not None:
                self._parked.withdraw(warm)
            if warm.area is not None and self._areas is not None:
                self._areas.release(warm.area)

    def _serve_next(self, channel: PsChannel, hello: Frame, warm: WarmBuffers) -> None:
        """Read and answer the connection's next request (a PUSH with the PULL right behind it:
        both), once its parked pull, if any, was answered."""
        self._parked.await_answer(channel, warm)
        frame = self._next_frame(channel, hello, warm)
        # counted while answered (every request of every step: plain code, no generator)
        with self._answered:
            self._answering += 1
        try:
            self._answer(channel, hello, warm, frame)
        finally:
            with self._answered:
                self._answering -= 1
                if not self._answering:
                    self._answered.notify_all()

    def _answer(self, channel: PsChannel, hello: Frame, warm: WarmBuffers, frame: Frame) -> None:
        """Answer ``frame`` (and the PULL right behind a PUSH, in one ``sendmsg``)."""
        self._parked.check_answered(warm)
        replies: list[Frame] = []
        if frame.kind is Kind.PUSH:
            ack = self._requests.handle(frame, warm)  # only a pull is ever parked
            assert ack is not None
            replies.append(ack)
            # the PULL that push_pull sent right behind its PUSH: both answers leave in
            # one sendmsg, so the worker wakes once (only behind an ACK: a WEIGHTS
            # answer's memory would be the next one's)
            if replies[0].kind is not Kind.ACK or not channel.pending():
                channel.send_many(replies)
                return
            frame = self._next_frame(channel, hello, warm)
        reply = self._requests.handle(frame, warm, (channel, replies))
        if reply is not None:  # None: parked, answered with ``replies`` ahead of it
            channel.send_many([*replies, reply])

    def _next_frame(self, channel: PsChannel, hello: Frame, warm: WarmBuffers) -> Frame:
        """The connection's next request, which must be of the rank and attempt of its HELLO."""
        frame = channel.recv(self._frame_cap, into=warm.push_payload)
        if (frame.rank, frame.attempt) != (hello.rank, hello.attempt):
            raise ProtocolError(
                f"a frame of rank {frame.rank} attempt {frame.attempt} on the connection of "
                f"rank {hello.rank} attempt {hello.attempt}"
            )
        return frame
