"""Where a barrier stage's workers meet before their process group exists: a server on the driver.

Spark's barrier ``allGather`` answers by polling every second: 1.0 s per stage whatever
the payload (measured), more than the whole training of a small fit. Each stage instead
opens this server on the driver's address, and every worker gathers through it once: it
says its message and gets every rank's back, in milliseconds. The same one call carries
everything the ranks tell each other before the process group exists (rank 0's store
address, each task's attempt id; :mod:`sparkdl.comm.rendezvous`).

A task cannot see its stage attempt (a re-run stage's tasks look like the first run's),
so the driver, which can, publishes each task's attempt (:meth:`MeetingPointServer.publish`,
fed by :class:`sparkdl.spark.attempts.AttemptPublisher`) and the server seats a worker at
its attempt's meeting by the task it names.

Its port is reachable by anyone on the cluster network, so it is held as the driver's other
ports are (:class:`~sparkdl.wire.listener.ConnectionListener`): a HELLO must verify under the
stage's own secret, the driver proves itself with its static key, and ``runtime.encrypt``
seals every connection. What it holds is bounded, whoever connects: a message of at most
:data:`~sparkdl.services.meeting.protocol.MAX_MESSAGE_BYTES` per waiting connection, whose
count the listener caps, and nothing once a meeting is over: an attempt's messages are
dropped once its ranks have them (the attempt then refuses newcomers: it meets once) or
once every rank waiting at it gave up. (It was a PyTorch ``TCPStore``, which authenticates
no one: anyone could store any number of keys of any size, or overwrite a rank's.)

Over Spark Connect there is no driver process of ours, and Spark's ``allGather`` stays.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Container
from dataclasses import dataclass, field

from sparkdl.errors import ConnectionClosed, ProtocolError, listed
from sparkdl.services.meeting.endpoint import MeetingPoint
from sparkdl.services.meeting.protocol import (
    MAX_MEETING_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_WORLD,
    MEETING_WIRE,
    Kind,
    MeetingChannel,
    Note,
    Seat,
    encode_met,
)
from sparkdl.wire.listener import ConnectionListener

log = logging.getLogger(__name__)

_DRAIN_S = 2.0


@dataclass
class _Meeting:
    """One stage attempt's meeting: what each rank said, until every rank has the answer."""

    world: int
    said: dict[int, str] = field(default_factory=dict)
    nbytes: int = 0  # of what the ranks said, at most MAX_MEETING_BYTES
    met: bytes = b""  # the answer, encoded once, when every rank said
    failed: str = ""  # why it failed (a rank did not come in time): every rank waiting is told
    waiting: int = 0  # connections seated here now


class MeetingPointServer:
    """The meeting point for one stage, open while it runs (a context manager).

    Args:
        host: the driver's address that executors reach; the server listens there only.
        timeout_s: how long a rank waits for the others (and for the driver to see its task).
        encrypt: encrypt every connection (``runtime.encrypt``).
        max_world: the most ranks a meeting seats.
        known: the executors' addresses (places are reserved for them; None: none known).
    """

    def __init__(
        self,
        host: str,
        timeout_s: float,
        encrypt: bool = False,
        max_world: int = MAX_WORLD,
        known: Container[str] | None = None,
    ) -> None:
        self._timeout_s = timeout_s
        self._max_world = max_world
        self._changed = threading.Condition()
        self._attempt_of: dict[int, tuple[int, int | None]] = {}  # task -> (attempt, rank), as Spark says
        self._closed = False
        self._meetings: dict[int, _Meeting] = {}  # stage attempt -> its meeting, while ranks wait
        self._met: set[int] = set()  # attempts whose ranks met: they meet once
        secret = secrets.token_bytes(32)
        self._listener = ConnectionListener(
            host,
            MEETING_WIRE,
            secret,
            self._serve,
            "sparkdl-meeting",
            log,
            encrypt=encrypt,
            max_sessions=max_world + 16,
            known=known,
        )
        self.endpoint = MeetingPoint(host, self._listener.port, secret, self._listener.public_key, encrypt)

    @property
    def held(self) -> int:
        """The bytes of messages held now, said or answered (read by tests)."""
        with self._changed:
            return sum(m.nbytes for m in self._meetings.values())

    def publish(self, task_id: int, attempt: int, rank: int | None = None) -> None:
        """Tell the server that task ``task_id`` runs in stage attempt ``attempt`` (a name:
        the attempt's smallest task id), as rank ``rank`` (its partition; None: any)."""
        with self._changed:
            self._attempt_of[task_id] = (attempt, rank)
            self._changed.notify_all()

    def close(self) -> None:
        """Wake every rank still waiting (each is told the stage is over), then stop."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._listener.stop(drain_s=_DRAIN_S)  # time for the woken ranks' answers to leave

    def __enter__(self) -> MeetingPointServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ connections

    def _serve(self, hello: Note, channel: MeetingChannel, peer: tuple[str, int]) -> None:
        seat = hello.seat
        try:
            channel.sock.settimeout(self._timeout_s + 30)
            channel.send(Note(Kind.ACK, seat))
            said = channel.recv(MAX_MESSAGE_BYTES)
            if said.kind is not Kind.SAY or said.seat != seat:
                raise ProtocolError(f"expected the SAY of {seat}, got a {said.kind.name} of {said.seat}")
            answer = self._meet(seat, said.text)
            if answer.kind is Kind.REFUSED:
                self._listener.refusals.add("meeting refused", peer, answer.text)
            channel.send(answer)
        except ConnectionClosed:
            pass
        except ProtocolError as exc:
            if not self._listener.stopping:
                self._listener.refusals.add("meeting refused", peer, str(exc))
        except OSError as exc:
            if not self._listener.stopping:
                log.warning("meeting point: the connection of %s (task %d) failed: %s", peer, seat.task, exc)

    def _meet(self, seat: Seat, text: str) -> Note:
        """Seat ``seat`` with its message at its stage attempt's meeting and wait for every
        rank's; the answer to send (MET, TIMED_OUT or REFUSED)."""
        deadline = time.monotonic() + self._timeout_s
        with self._changed:
            if not self._changed.wait_for(
                lambda: seat.task in self._attempt_of or self._closed, self._timeout_s
            ):
                return _note(Kind.TIMED_OUT, seat, f"the driver did not see task {seat.task} start within "
                             f"{self._timeout_s:.0f}s")  # fmt: skip
            if self._closed:
                return _note(Kind.REFUSED, seat, "the stage is over: its meeting point closed")
            attempt, rank = self._attempt_of[seat.task]
            nbytes = len(text.encode())
            refusal = self._refusal(seat, attempt, rank, nbytes)
            if refusal:
                return _note(Kind.REFUSED, seat, refusal)
            meeting = self._meetings.setdefault(attempt, _Meeting(seat.world))
            if meeting.failed:
                return _note(Kind.TIMED_OUT, seat, meeting.failed)
            meeting.said[seat.rank] = text
            meeting.nbytes += nbytes
            meeting.waiting += 1
            if len(meeting.said) == meeting.world:
                meeting.met = encode_met(tuple(meeting.said[r] for r in range(meeting.world)))
                meeting.said.clear()
                self._met.add(attempt)
                self._changed.notify_all()
            try:
                self._changed.wait_for(
                    lambda: bool(meeting.met or meeting.failed) or self._closed, deadline - time.monotonic()
                )
                if meeting.met:
                    return Note(Kind.MET, seat, encoded=meeting.met)
                if self._closed:
                    return _note(Kind.REFUSED, seat, "the stage is over: its meeting point closed")
                if not meeting.failed:  # the first rank to give up fails the meeting for all
                    missing = sorted(set(range(meeting.world)) - set(meeting.said))
                    meeting.failed = (
                        f"{len(missing)} of {meeting.world} ranks (ranks {listed(missing, 8)}) did not "
                        f"arrive within {self._timeout_s:.0f}s"
                    )
                    self._changed.notify_all()
                return _note(Kind.TIMED_OUT, seat, meeting.failed)
            finally:
                meeting.waiting -= 1
                if not meeting.waiting:  # everyone seated has its answer: nothing is kept
                    self._meetings.pop(attempt, None)

    def _refusal(self, seat: Seat, attempt: int, rank: int | None, nbytes: int) -> str:
        """Why ``seat`` cannot say ``nbytes`` at stage attempt ``attempt``'s meeting ("" if it
        can); the condition's lock held."""
        if rank is not None and seat.rank != rank:
            return f"task {seat.task} is rank {rank} of its stage, not {seat.rank}"
        if not 0 <= seat.rank < seat.world <= self._max_world:
            return (
                f"rank {seat.rank} of {seat.world}: a meeting seats ranks 0 to world - 1, "
                f"at most {self._max_world}"
            )
        if attempt in self._met:
            return f"stage attempt {attempt} met already: it meets once"
        meeting = self._meetings.get(attempt)
        if meeting is None:
            return ""
        if meeting.world != seat.world:
            return (
                f"rank {seat.rank} meets {seat.world} ranks, but stage attempt {attempt}'s first rank "
                f"said {meeting.world}"
            )
        if seat.rank in meeting.said:
            return (
                f"rank {seat.rank} of stage attempt {attempt} said its message already (a rank says it once)"
            )
        if meeting.nbytes + nbytes > MAX_MEETING_BYTES:
            return (
                f"stage attempt {attempt}'s meeting holds {meeting.nbytes} bytes; {MAX_MEETING_BYTES} at most"
            )
        return ""


def _note(kind: Kind, seat: Seat, text: str) -> Note:
    return Note(kind, seat, (text,))
