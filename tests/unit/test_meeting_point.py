"""The driver's meeting point: ranks gather through the real server on loopback, under the
stage attempt the driver published for their tasks, authenticated like every driver port
and bounded in what it holds; then each rank probes the others before forming the process
group."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from sparkdl.comm.rendezvous import probe_peers
from sparkdl.errors import RendezvousError, RendezvousTimeout
from sparkdl.services.meeting.client import gather_at
from sparkdl.services.meeting.protocol import MAX_MESSAGE_BYTES
from sparkdl.services.meeting.server import MeetingPointServer

HOST = "127.0.0.1"


def meet(server: MeetingPointServer, tasks: list[int], messages: list[str], timeout_s: float = 20.0):
    """Every rank's gather, each in its own thread, as the tasks of one attempt run."""
    world = len(tasks)
    with ThreadPoolExecutor(world) as pool:
        futures = [
            pool.submit(gather_at(server.endpoint, task, rank, world, timeout_s), messages[rank])
            for rank, task in enumerate(tasks)
        ]
        return [f.result(timeout=timeout_s + 10) for f in futures]


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@pytest.mark.parametrize("encrypt", [False, True])
def test_every_rank_gets_every_ranks_message_in_rank_order_and_nothing_is_kept(encrypt):
    with MeetingPointServer(HOST, 30.0, encrypt) as server:
        for rank, task in enumerate((12, 10, 11)):
            server.publish(task, 10, rank)
        answers = meet(server, [12, 10, 11], ['{"r": 0}', '{"r": 1}', '{"r": 2}'])
        assert server.held == 0  # the ranks have the messages: the server holds none
        with pytest.raises(RendezvousError, match="stage attempt 10 met already"):
            gather_at(server.endpoint, 10, 1, 3, 5.0)("late")  # an attempt meets once
    assert answers == [['{"r": 0}', '{"r": 1}', '{"r": 2}']] * 3


def test_a_re_run_attempt_never_reads_the_failed_attempts_messages():
    with MeetingPointServer(HOST, 1.0) as server:
        server.publish(0, 0)
        server.publish(1, 0)
        # attempt 0: rank 0 said its message, rank 1 died before it met (its wait times out)
        with pytest.raises(RendezvousTimeout):
            gather_at(server.endpoint, 0, 0, 2, 1.0)("attempt 0, rank 0")
        assert server.held == 0  # the failed meeting is dropped with its last waiter
        server.publish(2, 2)  # the re-run's tasks, published as the driver sees them start
        server.publish(3, 2)
        answers = meet(server, [2, 3], ["attempt 1, rank 0", "attempt 1, rank 1"], timeout_s=1.0)
    assert answers == [["attempt 1, rank 0", "attempt 1, rank 1"]] * 2


def test_a_task_waits_for_the_driver_to_publish_its_attempt():
    with MeetingPointServer(HOST, 30.0) as server:
        timer = threading.Timer(0.5, lambda: (server.publish(5, 5), server.publish(6, 5)))
        started = time.monotonic()
        timer.start()
        answers = meet(server, [5, 6], ["a", "b"])
        timer.join()
    assert answers == [["a", "b"]] * 2
    assert time.monotonic() - started >= 0.5


def test_without_the_stages_secret_nothing_is_stored_or_read():
    """It was a TCPStore: a client without the secret stored 64 x 4 MiB and could overwrite
    a rank's key. Now a store client, a raw writer and a client with a wrong secret are
    turned away at the handshake, and hold nothing."""
    with MeetingPointServer(HOST, 30.0) as server:
        point = server.endpoint
        server.publish(7, 7)
        server.publish(8, 7)
        with pytest.raises(Exception):  # noqa: B017 - the store's own error, whatever its wording
            intruder = dist.TCPStore(
                point.host, point.port, None, is_master=False, timeout=timedelta(seconds=2)
            )
            intruder.set("attempt-7/1", "x" * (4 << 20))
        writers = [socket.create_connection((point.host, point.port), timeout=5) for _ in range(8)]
        for writer in writers:
            try:
                writer.sendall(b"\0" * (4 << 20))  # the HELLO is 104 bytes: the rest is never read
            except OSError:  # closed once the bytes were no HELLO
                pass
        with pytest.raises(RendezvousError, match=r"the handshake with .* failed"):
            gather_at(dataclasses.replace(point, secret=b"x" * 32), 8, 1, 2, 5.0)("forged rank 1")
        assert server.held == 0
        answers = meet(server, [7, 8], ["rank 0", "rank 1"])  # the real ranks meet as before
        for writer in writers:
            writer.close()
        assert wait_until(lambda: server._listener.refusals.counts.get("HELLO refused", 0) >= 1)
    assert answers == [["rank 0", "rank 1"]] * 2


def test_what_a_secret_holder_says_is_bounded(monkeypatch):
    """A holder of the secret (a worker) seats at most max_world ranks, says at most
    MAX_MESSAGE_BYTES, once per rank, only as the rank Spark gave its task, within the
    meeting's byte cap, and for a task the driver saw start."""
    from sparkdl.services.meeting import server as server_module

    monkeypatch.setattr(server_module, "MAX_MEETING_BYTES", 2000)
    with MeetingPointServer(HOST, 2.0, max_world=4) as server:
        point = server.endpoint
        server.publish(1, 1, rank=0)
        with pytest.raises(RendezvousError, match="a meeting seats ranks 0 to world - 1, at most 4"):
            gather_at(point, 1, 0, 5, 2.0)("x")
        with pytest.raises(ValueError, match=f"at most {MAX_MESSAGE_BYTES} bytes"):
            gather_at(point, 1, 0, 1, 2.0)("x" * (MAX_MESSAGE_BYTES + 1))
        with pytest.raises(RendezvousError, match="task 1 is rank 0 of its stage, not 2"):
            gather_at(point, 1, 2, 3, 2.0)("posing as rank 2")
        with pytest.raises(RendezvousTimeout, match="the driver did not see task 99 start"):
            gather_at(point, 99, 0, 1, 1.0)("x")
        for task in (2, 3, 4):
            server.publish(task, 2)
        with ThreadPoolExecutor(2) as pool:  # rank 0 waits; a second rank 0 is refused
            first = pool.submit(gather_at(point, 2, 0, 3, 2.0), "a" * 1500)
            assert wait_until(lambda: server.held == 1500)
            with pytest.raises(RendezvousError, match="rank 0 of stage attempt 2 said its message already"):
                gather_at(point, 3, 0, 3, 2.0)("the same rank again")
            with pytest.raises(RendezvousError, match="holds 1500 bytes; 2000 at most"):
                gather_at(point, 4, 1, 3, 2.0)("b" * 600)
            with pytest.raises(RendezvousTimeout):
                first.result(timeout=10)
        assert server.held == 0
        counts = server._listener.refusals.counts
        assert counts.get("meeting refused") == 4, counts


def test_a_rank_that_gives_up_fails_the_meeting_for_every_rank_and_a_closing_server_wakes_them():
    """Ranks of one meeting get one outcome: the first rank whose wait ends fails it for all
    (a later rank cannot complete it without that rank). And a server closed while ranks
    wait tells them at once instead of holding the stage's end for their whole timeout."""
    with MeetingPointServer(HOST, 1.0) as server:
        for task in (1, 2, 3):
            server.publish(task, 1)
        with pytest.raises(RendezvousTimeout, match="2 of 3 ranks"):
            gather_at(server.endpoint, 1, 0, 3, 1.0)("rank 0")
        with pytest.raises(RendezvousTimeout):  # the meeting is gone with its last waiter
            gather_at(server.endpoint, 2, 1, 3, 1.0)("rank 1")
    server = MeetingPointServer(HOST, 60.0)
    server.publish(5, 5)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(gather_at(server.endpoint, 5, 0, 2, 60.0), "alone")
        assert wait_until(lambda: server.held > 0)
        started = time.monotonic()
        server.close()
        with pytest.raises(RendezvousError, match="the stage is over"):
            waiting.result(timeout=30)
        assert time.monotonic() - started < 5


def test_a_rank_that_never_comes_fails_the_others_within_the_bound_naming_it_and_the_setting():
    with MeetingPointServer(HOST, 1.0) as server:
        server.publish(1, 1)
        server.publish(2, 1)
        started = time.monotonic()
        with pytest.raises(RendezvousTimeout) as raised:
            gather_at(server.endpoint, 1, 0, 2, 1.0)("alone")
        assert time.monotonic() - started < 10
    assert raised.value.setting == "runtime.collective_timeout_s" and raised.value.limit_s == 1.0
    assert "did not all meet at the driver's meeting point 127.0.0.1:" in str(raised.value)
    assert "1 of 2 ranks (ranks 1) did not arrive within 1s" in str(raised.value)


def test_the_server_listens_on_the_drivers_address_only_and_its_endpoint_hides_the_secret():
    with MeetingPointServer(HOST, 30.0) as server:
        assert server.endpoint.host == HOST and server.endpoint.secret not in repr(server.endpoint).encode()
        assert repr(server.endpoint) == f"MeetingPoint({HOST}:{server.endpoint.port})"
        with pytest.raises(ConnectionRefusedError):  # bound to 127.0.0.1, not to every address
            socket.create_connection(("127.0.0.2", server.endpoint.port), timeout=5).close()
        socket.create_connection((HOST, server.endpoint.port), timeout=5).close()


def test_a_rank_that_cannot_reach_another_fails_in_seconds_naming_both_ends():
    with socket.create_server((HOST, 0)) as mine, socket.create_server((HOST, 0)) as theirs:
        closed = socket.create_server((HOST, 0))
        closed_port = closed.getsockname()[1]
        closed.close()  # nothing listens there now: refused, as behind a firewall or a wrong address
        peers = [(HOST, mine.getsockname()[1]), (HOST, theirs.getsockname()[1])]
        probe_peers(0, HOST, peers, 5.0)  # every other rank answers
        started = time.monotonic()
        with pytest.raises(RendezvousError) as raised:
            probe_peers(0, HOST, [*peers, (HOST, closed_port)], 5.0)
        assert time.monotonic() - started < 5
    message = str(raised.value)
    assert message.startswith(f"rank 0 at {HOST} cannot reach rank 2 at {HOST}:{closed_port} (")
    assert "set runtime.network_interface to the interface they share" in message


def _two_fits_in_one_process(out) -> None:
    """Form and release the process group twice, as a reused Python worker runs two fits,
    while the first fit's store outlives its fit (held by a reference cycle until a
    garbage collection); then collect it and use the second fit's store."""
    import gc

    from sparkdl.comm.rendezvous import form_process_group

    try:
        first = form_process_group(0, 1, "127.0.0.1", "gloo", lambda message: [message], 20.0)
        first.destroy()
        cycle: list = [first.store]
        cycle.append(cycle)  # freed by the collector only
        del first
        second = form_process_group(0, 1, "127.0.0.1", "gloo", lambda message: [message], 20.0)
        port = second.store.port
        del cycle
        gc.collect()  # the first store goes, and closes the socket it was given
        client = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=5))
        client.set("still", "served")
        out.put((second.store.get("still").decode(), None))
        second.destroy()
    except Exception as exc:
        out.put((None, f"{type(exc).__name__}: {exc}"))


def test_a_fits_store_released_late_never_closes_a_later_fits_socket():
    """Rank 0's store owns its listening socket alone: the socket was also closed by our
    own handle at teardown, so the store's late close hit whatever socket reused the
    number: the next fit in the same worker lost its store's socket (EBADF at its end)."""
    from tests.workers import worker_context

    ctx = worker_context()
    out = ctx.Queue()
    process = ctx.Process(target=_two_fits_in_one_process, args=(out,))
    process.start()
    value, error = out.get(timeout=60)
    process.join(30)
    assert error is None and value == "served", error
