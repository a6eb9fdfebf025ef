"""A worker's side of its stage's meeting point (:mod:`sparkdl.services.meeting.server`)."""

from __future__ import annotations

import socket

from sparkdl.comm.rendezvous import AllGather
from sparkdl.errors import ConnectionClosed, ProtocolError, RendezvousError, RendezvousTimeout, ServerBusy
from sparkdl.services.meeting.endpoint import MeetingPoint
from sparkdl.services.meeting.protocol import (
    MAX_MESSAGE_BYTES,
    Kind,
    MeetingChannel,
    Note,
    Seat,
    client_hello,
    met_bytes,
)
from sparkdl.wire.handshake import with_retries
from sparkdl.wire.refusals import close_quietly

_CONNECT_S = 30.0  # the longest a connect may take (a dropped SYN); the wait for the others is longer


def gather_at(point: MeetingPoint, task_id: int, rank: int, world_size: int, timeout_s: float) -> AllGather:
    """An all-gather of one string per rank through ``point``, among the ranks of task
    ``task_id``'s stage attempt (which the driver knows).

    Call the result once per worker, as Spark's ``allGather``.

    Raises (from the call):
        RendezvousTimeout: the meeting point was not reached, or a rank did not arrive, in time.
        RendezvousError: the meeting point refused this rank (a task the driver never saw
            start, an attempt that met already), or answered what no meeting point would.
    """
    seat = Seat(task_id, rank, world_size)
    where = f"the driver's meeting point {point.host}:{point.port}"

    def timed_out(why: str) -> RendezvousTimeout:
        return RendezvousTimeout(
            f"rank {rank}/{world_size}: the workers did not all meet at {where}: {why}; check that "
            "executors reach the driver on that address (spark.driver.host) and that every task "
            "started, or raise runtime.collective_timeout_s",
            setting="runtime.collective_timeout_s",
            limit_s=timeout_s,
        )

    def gather(message: str) -> list[str]:
        if len(message.encode()) > MAX_MESSAGE_BYTES:
            raise ValueError(f"a rank says at most {MAX_MESSAGE_BYTES} bytes at the meeting point")
        try:
            sock, channel = with_retries(lambda: _open(point, seat), f"rank {rank}: meeting point")
        except (ServerBusy, OSError) as exc:
            raise timed_out(f"it could not be reached ({exc})") from exc
        except ProtocolError as exc:  # another server's key, a refused HELLO
            raise RendezvousError(
                f"rank {rank}/{world_size}: the handshake with {where} failed: {exc}"
            ) from exc
        try:
            sock.settimeout(timeout_s + _CONNECT_S)  # the server answers first, at timeout_s
            channel.send(Note(Kind.SAY, seat, (message,)))
            answer = channel.recv(met_bytes(world_size))
        except (ConnectionClosed, OSError) as exc:
            raise timed_out(f"the connection failed ({exc})") from exc
        except ProtocolError as exc:
            raise RendezvousError(
                f"rank {rank}/{world_size}: {where} sent what no meeting point would: {exc}"
            ) from exc
        finally:
            close_quietly(sock)
        if answer.kind is Kind.MET and answer.seat == seat:
            if answer.texts[rank] != message:  # the server seats a rank once: this cannot happen
                raise RendezvousError(
                    f"rank {rank}/{world_size}: {where} answered with another message under this "
                    "rank than the one it said"
                )
            return list(answer.texts)
        if answer.kind is Kind.TIMED_OUT:
            raise timed_out(answer.text)
        raise RendezvousError(
            f"rank {rank}/{world_size}: {where} refused this rank: {answer.text or answer.kind.name}"
        )

    return gather


def _open(point: MeetingPoint, seat: Seat) -> tuple[socket.socket, MeetingChannel]:
    """Connect, HELLO, and the server's ACK."""
    sock = socket.create_connection((point.host, point.port), timeout=_CONNECT_S)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = client_hello(sock, point.secret, seat, point.encrypt, server_key=point.server_key)
        ack = channel.recv(0)
        if ack.kind is not Kind.ACK or ack.seat != seat:
            raise ProtocolError(f"the meeting point answered the HELLO with a {ack.kind.name}")
        return sock, channel
    except BaseException:
        close_quietly(sock)
        raise
