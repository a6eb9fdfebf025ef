"""Parked pulls: a pull that must wait for other workers' pushes, answered by the push that
makes it answerable instead of by a thread that waits for it.

A pull through shared memory (its answer is a header; the weights go into the worker's
area) of a small shard (``sparkdl.services.ps.server.PARK_MAX_VALUES`` says which, and why)
that cannot be answered yet is not waited for on its connection's thread: it is parked
here, and the push that makes it answerable writes the weights into that worker's area and
sends the answer (a header). An abort, or the server stopping, answers it with the error
a waiting pull gets. Its connection's thread sleeps on the socket until the worker's next
request, or answers the pull with a timeout at its deadline; it is not woken in between.

Concurrency, which lock guards what and who sends on a channel when:

- Each shard has its parked pulls and a lock (:class:`ShardParking`). The lock orders
  parking a pull, answering it, and the connection's next frame. A pull is parked under
  it (the store is asked once more, under the lock, before it parks), so the push that
  completes its clock, which answers the shard's parked pulls under the same lock, finds it.
- ``WarmBuffers.waiting`` (the connection's parked pull) is set and cleared only under the
  lock of its shard.
- The pull stays parked until its answer is sent: the thread that answers it sends under
  the lock (:meth:`ParkedPulls.deliver`), and the connection's own thread, which reads the
  worker's next request meanwhile, waits for the lock before it answers
  (:meth:`ParkedPulls.check_answered`), so one thread at a time sends on the channel.
  A worker sends its next request only once its parked pull was answered; one that does
  not is cut off.
- A parked answer is sent without waiting: a worker that leaves its answers unread is cut
  off, never waited for.
- The lock is taken before the store's own (asking the store for the weights or for a
  timeout's message); the store never calls back here.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from sparkdl.errors import ParameterServerError, ProtocolError
from sparkdl.services.ps.connection import Park, Waiting, WarmBuffers
from sparkdl.services.ps.protocol import Frame, PsChannel, error_frame
from sparkdl.services.ps.store import ShardStore
from sparkdl.wire.refusals import Refusals

#: The WEIGHTS answer to a pull now, in its connection's buffers; None while it must wait.
TryWeights = Callable[[Frame, WarmBuffers], Frame | None]


class ShardParking:
    """The parked pulls of one shard. Its lock orders parking a pull, answering it, and the
    connection's next frame."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: list[Waiting] = []


class ParkedPulls:
    """Every shard's parked pulls: parks them, answers them, cuts off who does not read.

    Args:
        stores: one :class:`ShardStore` per shard (asked for a timed-out pull's message).
        timeout_s: how long a parked pull may wait (``runtime.ps_timeout_s``).
        try_weights: a pull's answer now, or None while it must wait.
        refusals: where an undeliverable answer is counted and logged.
    """

    def __init__(
        self, stores: Sequence[ShardStore], timeout_s: float, try_weights: TryWeights, refusals: Refusals
    ) -> None:
        self._stores = stores
        self._timeout_s = timeout_s
        self._try_weights = try_weights
        self._refusals = refusals
        self._shards = [ShardParking() for _ in stores]

    def __getitem__(self, shard: int) -> ShardParking:
        return self._shards[shard]

    def __iter__(self) -> Iterator[ShardParking]:
        return iter(self._shards)

    def park(self, pull: Frame, warm: WarmBuffers, park: Park) -> Frame | None:
        """The answer to ``pull`` if it may be answered now; None when it was parked instead
        (``park``: its channel, and the answers that go ahead of it)."""
        parked = self._shards[pull.shard]
        with parked.lock:
            reply = self._try_weights(pull, warm)
            if reply is None:
                warm.waiting = Waiting(pull, warm, *park, time.monotonic() + self._timeout_s)
                parked.waiting.append(warm.waiting)
            return reply

    def answer(self, shard: int) -> None:
        """Answer the parked pulls of ``shard`` that a push (or an abort) made answerable."""
        parked = self._shards[shard]
        with parked.lock:
            if not parked.waiting:  # after every push: usually none
                return
            for waiting in list(parked.waiting):
                reply = self._reply(waiting)
                if reply is not None:
                    self.deliver(parked, waiting, reply)

    def _reply(self, waiting: Waiting) -> Frame | None:
        """A parked pull's answer now: its weights, or the ERROR of an aborted attempt or a
        stopping server; None while it must wait."""
        try:
            return self._try_weights(waiting.pull, waiting.warm)
        except ParameterServerError as exc:
            return error_frame(exc, waiting.pull.shard)

    def await_answer(self, channel: PsChannel, warm: WarmBuffers) -> None:
        """While this connection's pull is parked: sleep until the worker's next frame, or
        answer the pull at its deadline (then read on): with the weights if the push that
        makes it answerable has not answered it yet, with a timeout otherwise."""
        waiting = warm.waiting
        if waiting is None:
            return
        while (remaining := waiting.deadline - time.monotonic()) > 0:
            if channel.pending(remaining):  # a poll waits 24 days at most: ask again after
                return
        parked = self._shards[waiting.pull.shard]
        with parked.lock:
            if warm.waiting is not waiting:  # answered meanwhile
                return
            reply = self._reply(waiting)
            if reply is None:
                store = self._stores[waiting.pull.shard]
                error = store.pull_timeout(waiting.pull.rank, waiting.pull.clock, self._timeout_s)
                reply = error_frame(error, waiting.pull.shard)
            self.deliver(parked, waiting, reply)

    def check_answered(self, warm: WarmBuffers) -> None:
        """A worker sends its next request only once its parked pull was answered."""
        waiting = warm.waiting
        if waiting is not None:
            with self._shards[waiting.pull.shard].lock:
                if warm.waiting is not None:
                    raise ProtocolError(
                        f"rank {waiting.pull.rank} sent a request while its pull of clock "
                        f"{waiting.pull.clock} waited for its answer"
                    )

    def deliver(self, parked: ShardParking, waiting: Waiting, reply: Frame) -> None:
        """Send a parked pull's answer, behind the answers that go ahead of it, under the
        shard's parked lock. The pull stays parked until the answer is sent: the
        connection's own thread, which reads the worker's next request meanwhile, waits
        for the lock before it answers (:meth:`check_answered`), so one thread at a time
        sends on the channel. A worker that leaves its answers unread is cut off, never
        waited for."""
        try:
            waiting.channel.send_many([*waiting.before, reply], wait=False)
        except BlockingIOError as exc:  # its socket's buffer is full: it reads no answers
            self._refusals.add("answer undeliverable", ("rank", waiting.pull.rank), str(exc))
            try:
                waiting.channel.sock.shutdown(socket.SHUT_RDWR)  # its thread then ends
            except OSError:
                pass
        except OSError:
            pass  # the worker went away: its thread finds the connection closed
        finally:
            parked.waiting.remove(waiting)
            waiting.warm.waiting = None

    def withdraw(self, warm: WarmBuffers) -> None:
        """The connection ends: its parked pull, if still unanswered, is dropped."""
        waiting = warm.waiting
        if waiting is not None:
            parked = self._shards[waiting.pull.shard]
            with parked.lock:
                if warm.waiting is waiting:
                    parked.waiting.remove(waiting)
                    warm.waiting = None
