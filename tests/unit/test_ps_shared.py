"""The parameter server's shared memory for workers on its host (:mod:`sparkdl.comm.ps_areas`):
the same numbers as over the sockets, only headers on the wire, areas handed out and
taken back, a worker in another process attaching through ``/proc``, and frames that name
an area not theirs refused."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
import traceback

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl.comm import ps_areas as areas
from sparkdl.comm.compression.codecs import ErrorFeedback, OneBit
from sparkdl.errors import ConnectionClosed, PeerStopped, PsTimeoutError
from sparkdl.services.ps import server as server_module
from sparkdl.services.ps.client import PsClient
from sparkdl.services.ps.parking import ParkedPulls
from sparkdl.services.ps.protocol import PS_WIRE, Frame, Kind, client_hello
from sparkdl.services.ps.server import ParameterServer, _Waiting, _WarmBuffers
from sparkdl.services.ps.store import PsMode, ShardStore
from sparkdl.wire.framing import TAG_BYTES, Channel, frame_bytes
from tests.workers import worker_context

SECRET = b"s" * 32
VALUES = ((1.0, 2.0, -0.5), tuple(float(v) / 7 for v in range(1, 300)))
HEADER_ONLY = frame_bytes(PS_WIRE.header.size, 0)  # a frame without payload, on the wire


def stores(workers=2, mode=PsMode.SYNC):
    def momentum(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    return [ShardStore([nn.Parameter(torch.tensor(v))], momentum, mode, workers) for v in VALUES]


def serve(shared_bytes=1 << 20, workers=2):
    return ParameterServer(
        stores(workers),
        "127.0.0.1",
        SECRET,
        timeout_s=10.0,
        max_payload=1 << 20,
        shared_memory_bytes=shared_bytes,
    )


def gradient(rank, step, shard):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + shard)
    return torch.randn(len(VALUES[shard]), generator=g)


def on_threads(work, ranks, timeout):
    """``work(rank)`` for each of ``ranks`` ranks, each on its own thread; waits for them
    (at most ``timeout`` seconds each)."""
    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)


def train(ps, options=lambda rank: {}, steps=4):
    """Two workers push+pull every step in sync mode; their final weights (equal on both) and
    their clients (closed)."""
    endpoint = ps.endpoint(((0,), (1,)))
    clients = [PsClient(endpoint, rank, 0, **options(rank)) for rank in range(2)]
    finals: dict[int, list[list[float]]] = {}

    def work(rank):
        for step in range(steps):
            grads = [gradient(rank, step, shard) for shard in range(2)]
            pulled = clients[rank].push_pull(step, 3 + rank, grads, step + 1)
        finals[rank] = [w.tolist() for _, w in pulled]

    try:
        on_threads(work, 2, timeout=30)
    finally:
        for c in clients:
            c.close()
    assert finals[0] == finals[1]
    return finals[0], clients


def trained(shared_bytes, options=lambda rank: {}, steps=4):
    ps = serve(shared_bytes)
    try:
        return train(ps, options, steps)
    finally:
        ps.stop()


OPTIONS = {
    "float32": lambda rank: {},
    "bf16 pulls": lambda rank: {"bf16_pulls": True},
    "1-bit pushes": lambda rank: {"feedback": ErrorFeedback(OneBit())},  # one residual per worker
}


@pytest.mark.parametrize("name", OPTIONS)
def test_shared_memory_gives_the_sockets_weights_bit_for_bit_with_only_headers_on_the_wire(name):
    steps = 4
    by_socket, socket_clients = trained(0, OPTIONS[name], steps)
    shared, shared_clients = trained(1 << 20, OPTIONS[name], steps)
    assert shared == by_socket
    assert shared != [list(v) for v in VALUES]  # the steps moved the weights
    for on_socket, in_memory in zip(socket_clients, shared_clients, strict=True):
        assert (on_socket.shared_areas, in_memory.shared_areas) == (0, 2)
        assert in_memory.stats.shared_sent > 0 and on_socket.stats.shared_sent == 0
        # the same payload bytes either way, less the tag a PUSH's payload carries on the wire (one:
        # each is under STREAM_CHUNK); on the wire, a PUSH and a PULL per shard and step, headers only
        assert in_memory.stats.bytes_sent == on_socket.stats.bytes_sent - steps * 2 * TAG_BYTES
        assert in_memory.stats.bytes_received == on_socket.stats.bytes_received
        assert in_memory.stats.bytes_sent - in_memory.stats.shared_sent == steps * 2 * 2 * HEADER_ONLY


def _worker_in_another_process(endpoint, out):
    try:
        client = PsClient(endpoint, 1, 0)
        try:
            pulled = client.push_pull(0, 4, [gradient(1, 0, 0), gradient(1, 0, 1)], 1)
            out.put((client.shared_areas, [w.tolist() for _, w in pulled]))
        finally:
            client.close()
    except BaseException:
        out.put(traceback.format_exc())


def test_a_worker_in_another_process_of_the_host_attaches_through_proc_and_trains():
    ps = serve()
    try:
        endpoint = ps.endpoint(((0,), (1,)))
        ctx = worker_context()
        out = ctx.Queue()
        proc = ctx.Process(target=_worker_in_another_process, args=(endpoint, out))
        proc.start()
        here = PsClient(endpoint, 0, 0)
        try:
            mine = here.push_pull(0, 3, [gradient(0, 0, 0), gradient(0, 0, 1)], 1)
            result = out.get(timeout=120)
        finally:
            here.close()
            proc.join(30)
        assert not isinstance(result, str), result
        areas_there, theirs = result
        assert areas_there == 2 and here.shared_areas == 2
        assert theirs == [w.tolist() for _, w in mine]
    finally:
        ps.stop()
    reference, _ = trained(0, steps=1)
    assert theirs == reference


def test_areas_run_out_then_connections_use_their_sockets_and_a_closed_one_gives_its_area_back():
    one_area = areas.slot_bytes(4 * len(VALUES[1]), 4 * len(VALUES[1]))  # the largest shard's
    ps = serve(2 * one_area)  # two areas: one worker's two connections
    try:
        assert ps.areas is not None and ps.areas.info.slots == 2
        weights, clients = train(ps)
        assert sorted(c.shared_areas for c in clients) == [0, 2]
        assert weights == trained(0)[0]
        again = PsClient(ps.endpoint(((0,), (1,))), 0, 0)  # the closed connections gave theirs back
        try:
            assert again.shared_areas == 2
        finally:
            again.close()
    finally:
        ps.stop()
    too_small = serve(one_area - 1)
    try:
        assert too_small.areas is None  # not even one area fits: sockets only
    finally:
        too_small.stop()


def granted_channel(ps, want_area=True, rank=0, encrypt=False):
    """A raw worker connection; the ACK's area field."""
    sock = socket.create_connection((ps.host, ps.port), timeout=5)
    channel = client_hello(
        sock, SECRET, rank, 0, encrypt=encrypt, want_area=want_area, server_key=ps.public_key
    )
    return channel, channel.recv(1 << 20).area


@pytest.mark.parametrize(
    "frame, want_area, refusal",
    [
        (
            Frame(Kind.PUSH, 0, 0, 0, 0, 1, b"", area=1),
            False,
            "names shared area 0, the connection holds none",
        ),
        (Frame(Kind.PULL, 0, 0, 0, 1, area=2), True, "names shared area 1, the connection holds 0"),
        (Frame(Kind.PUSH, 0, 0, 0, 0, 1, b"\0" * 12, area=1), True, "carries a payload as well"),
    ],
    ids=["no area granted", "another connection's area", "area and payload"],
)
def test_a_frame_that_names_an_area_not_its_own_closes_its_connection(frame, want_area, refusal, caplog):
    ps = serve()
    try:
        channel, granted = granted_channel(ps, want_area)
        try:
            assert granted == (1 if want_area else 0)
            channel.send(frame)
            with pytest.raises(ConnectionClosed):
                channel.recv(1 << 20)
        finally:
            channel.sock.close()
        assert refusal in caplog.text and ps.refusals.get("frame refused") == 1
        weights, clients = train(ps)  # the others are not affected
        assert weights == trained(0)[0] and all(c.shared_areas == 2 for c in clients)
    finally:
        ps.stop()


def test_a_worker_uses_its_socket_where_the_segment_is_not_the_servers():
    ps = serve()
    try:
        info = ps.areas.info
        assert areas.attach(info) is not None
        for wrong in (
            dataclasses.replace(info, token=os.urandom(32)),  # a recycled pid's fd, say
            dataclasses.replace(info, host="another-boot another-namespace"),
            dataclasses.replace(info, fd=info.fd + 1000),  # no such fd
            dataclasses.replace(info, slots=info.slots + 1),  # another size
            None,
        ):
            assert areas.attach(wrong) is None
        endpoint = dataclasses.replace(
            ps.endpoint(((0,), (1,))), areas=dataclasses.replace(info, token=os.urandom(32))
        )
        client = PsClient(endpoint, 0, 0)
        try:
            assert client.shared_areas == 0
            ((_, w0), _) = client.pull(0)
            assert w0.tolist() == list(VALUES[0])
        finally:
            client.close()
    finally:
        ps.stop()
    assert not os.path.exists(f"/proc/self/fd/{info.fd}")  # stop() closed the segment


def test_a_push_whose_area_bytes_are_not_the_shards_is_rejected_and_applies_nothing():
    ps = serve()
    try:
        channel, granted = granted_channel(ps)
        try:
            assert granted == 1
            channel.send(Frame(Kind.PUSH, 1, 0, 0, 0, 1, b"", area=1, area_bytes=12))  # shard 1 takes 1196
            reply = channel.recv(1 << 20)
            assert reply.kind is Kind.ERROR
            assert "push of 12 bytes to shard 1, which takes 1196 bytes" in bytes(reply.payload).decode()
        finally:
            channel.sock.close()
        assert ps.stores[1].version == 0 and ps.rejected_pushes == 1
    finally:
        ps.stop()


def test_no_process_can_resize_the_segment_under_the_server():
    """A worker maps it read-write; shrinking it would make the server's next write a SIGBUS."""
    ps = serve()
    try:
        fd = os.open(f"/proc/self/fd/{ps.areas.info.fd}", os.O_RDWR)
        try:
            for size in (0, ps.areas.info.size + 4096):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
        finally:
            os.close(fd)
        assert train(ps)[0] == trained(0)[0]
    finally:
        ps.stop()


def test_encrypted_connections_and_async_mode_use_the_areas_with_the_sockets_numbers():
    def run(shared, encrypt, mode):
        stores_ = stores(workers=1, mode=mode)
        ps = ParameterServer(
            stores_, "127.0.0.1", SECRET, 10.0, 1 << 20, encrypt=encrypt, shared_memory_bytes=shared
        )
        try:
            client = PsClient(ps.endpoint(((0,), (1,))), 0, 0)
            try:
                assert client.shared_areas == (2 if shared else 0)
                for step in range(3):  # one worker: async applies each push, in order
                    pulled = client.push_pull(step, 2, [gradient(0, step, s) for s in range(2)], step + 1)
                return [w.tolist() for _, w in pulled]
            finally:
                client.close()
        finally:
            ps.stop()

    for mode in (PsMode.SYNC, PsMode.ASYNC):
        expected = run(0, False, mode)
        assert run(1 << 20, True, mode) == expected and run(1 << 20, False, mode) == expected


# --- parked pulls: answered by the push that completes their clock --------------------


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not condition():
        time.sleep(0.005)
    return condition()


def parked(ps):
    """How many pulls wait parked, per shard."""
    return [len(each.waiting) for each in ps._parked]


def step_grads(rank, step=0):
    return [gradient(rank, step, shard) for shard in range(2)]


def in_background(call):
    """Run ``call`` on a thread; (the thread, a dict that receives its result or error)."""
    outcome = {}

    def run():
        try:
            outcome["result"] = call()
        except BaseException as exc:  # handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@contextlib.contextmanager
def rank_0_waiting(ps, parks=True):
    """Two workers of ``ps``; rank 0's push_pull of clock 0 runs in the background, its
    pulls waiting for rank 1 (parked on both shards, when ``parks``). Yields rank 0's and
    rank 1's clients, the background thread and its outcome; closes the clients after."""
    endpoint = ps.endpoint(((0,), (1,)))
    first, second = (PsClient(endpoint, rank, 0) for rank in range(2))
    try:
        thread, outcome = in_background(lambda: first.push_pull(0, 3, step_grads(0), 1))
        if parks:
            assert wait_until(lambda: parked(ps) == [1, 1])
        else:
            time.sleep(0.2)
            assert parked(ps) == [0, 0]
        assert thread.is_alive()
        yield first, second, thread, outcome
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("parks", [True, False], ids=["small shards park", "large shards wait"])
def test_a_parked_pull_is_answered_by_the_push_that_completes_its_clock(parks, monkeypatch):
    delivered = []
    deliver = ParkedPulls.deliver
    monkeypatch.setattr(ParkedPulls, "deliver", lambda self, *a: delivered.append(a) or deliver(self, *a))
    if parks:  # no pull through shared memory may wait on its connection's thread
        monkeypatch.setattr(ShardStore, "pull", lambda *a, **k: pytest.fail("a parked pull waited"))
    else:
        monkeypatch.setattr(server_module, "PARK_MAX_VALUES", 2)  # the shards hold 3 and 299 values
    ps = serve()
    try:
        with rank_0_waiting(ps, parks) as (first, second, thread, outcome):
            theirs = [w.tolist() for _, w in second.push_pull(0, 4, step_grads(1), 1)]
            thread.join(10)
            assert [w.tolist() for _, w in outcome["result"]] == theirs
            assert first.shared_areas == second.shared_areas == 2
        assert parked(ps) == [0, 0] and len(delivered) == (2 if parks else 0)
    finally:
        ps.stop()
    monkeypatch.undo()
    reference, _ = trained(0, steps=1)  # over the sockets, pulls wait on their threads
    assert theirs == reference


def test_a_parked_pull_times_out_naming_the_worker_waited_for_and_its_connection_lives():
    ps = ParameterServer(stores(), "127.0.0.1", SECRET, 1.0, 1 << 20, shared_memory_bytes=1 << 20)
    try:
        endpoint = ps.endpoint(((0,), (1,)))
        first, second = (PsClient(endpoint, rank, 0) for rank in range(2))
        try:
            started = time.monotonic()
            with pytest.raises(
                PsTimeoutError, match=r"rank 0: pull of clock 1 waited 1s for worker\(s\) \[1\]"
            ):
                first.push_pull(0, 3, step_grads(0), 1)
            assert 0.9 < time.monotonic() - started < 5
            assert wait_until(lambda: parked(ps) == [0, 0])  # each shard's pull timed out
            second.push(0, 4, step_grads(1))  # the late push: now the pull is answerable
            mine = [w.tolist() for _, w in first.pull(1)]
        finally:
            first.close()
            second.close()
    finally:
        ps.stop()
    assert mine == trained(0, steps=1)[0]


def test_an_abort_answers_every_shards_parked_pulls_at_once():
    ps = serve()  # pulls time out after 10 s
    try:
        with rank_0_waiting(ps) as (_, second, thread, outcome):
            started = time.monotonic()
            second.abort("its loss was nan")
            thread.join(10)
            assert time.monotonic() - started < 5
            assert isinstance(outcome.get("error"), PeerStopped)
            assert str(outcome["error"]) == "rank 0: rank 1 stopped: its loss was nan"
            assert parked(ps) == [0, 0]
    finally:
        ps.stop()


def test_a_request_sent_while_its_pull_is_parked_closes_the_connection(caplog):
    ps = serve()
    try:
        channel, granted = granted_channel(ps)
        try:
            assert granted == 1
            push = Frame(Kind.PUSH, 0, 0, 0, 0, 3, b"", area=1, area_bytes=12)  # the area's zeros
            channel.send_many([push, Frame(Kind.PULL, 0, 0, 0, 1, area=1)])
            assert wait_until(lambda: parked(ps) == [1, 0])
            channel.send(Frame(Kind.PULL, 0, 0, 0, 1, area=1))  # without waiting for the answer
            with pytest.raises(ConnectionClosed):  # the push's ACK waited with the pull: none came
                channel.recv(1 << 20)
        finally:
            channel.sock.close()
        assert "rank 0 sent a request while its pull of clock 1 waited for its answer" in caplog.text
        assert ps.refusals.get("frame refused") == 1 and parked(ps) == [0, 0]
    finally:
        ps.stop()


def test_an_answer_a_worker_leaves_unread_cuts_it_off_without_waiting():
    ps = serve()
    worker, server_end = socket.socketpair()
    try:
        server_end.setblocking(False)
        for _ in range(10_000):  # the worker reads nothing: fill the server's side
            try:
                server_end.send(b"\0" * 65536)
            except BlockingIOError:
                break
        server_end.setblocking(True)  # as a session's socket is
        channel = Channel(server_end, SECRET, PS_WIRE, b"t" * 32, client=False)
        warm = _WarmBuffers()
        warm.waiting = _Waiting(
            Frame(Kind.PULL, 0, 0, 0, 1), warm, channel, [Frame(Kind.ACK)], time.monotonic()
        )
        ps._parked[0].waiting.append(warm.waiting)
        started = time.monotonic()
        with ps._parked[0].lock:
            ps._parked.deliver(ps._parked[0], warm.waiting, Frame(Kind.WEIGHTS))
        assert time.monotonic() - started < 1
        assert ps.refusals.get("answer undeliverable") == 1
        assert warm.waiting is None and parked(ps) == [0, 0]
        assert server_end.recv(1) == b""  # shut down: its connection's thread would read the end
    finally:
        worker.close()
        server_end.close()
        ps.stop()


def test_an_answer_to_a_worker_that_went_away_is_dropped_without_a_refusal():
    ps = serve()
    worker, server_end = socket.socketpair()
    try:
        worker.close()  # its task died while its pull was parked
        channel = Channel(server_end, SECRET, PS_WIRE, b"t" * 32, client=False)
        warm = _WarmBuffers()
        warm.waiting = _Waiting(Frame(Kind.PULL, 0, 0, 0, 1), warm, channel, [], time.monotonic())
        ps._parked[0].waiting.append(warm.waiting)
        with ps._parked[0].lock:
            ps._parked.deliver(ps._parked[0], warm.waiting, Frame(Kind.WEIGHTS))
        assert ps.refusals == {} and warm.waiting is None and parked(ps) == [0, 0]
    finally:
        server_end.close()
        ps.stop()


def test_a_parked_pull_waits_out_any_timeout_the_settings_allow():
    """poll() takes at most 24.8 days; a longer ps_timeout_s is waited in turns."""
    ps = ParameterServer(stores(), "127.0.0.1", SECRET, 3e6, 1 << 20, shared_memory_bytes=1 << 20)
    try:
        weights, clients = train(ps)
        assert all(c.shared_areas == 2 for c in clients)
    finally:
        ps.stop()
    assert weights == trained(0)[0]


def test_a_parked_pull_whose_clock_was_applied_by_its_deadline_gets_the_weights_not_a_timeout(monkeypatch):
    answer_parked = ParkedPulls.answer

    def late(self, shard):  # the completing push's thread loses the race with the deadline
        time.sleep(1.5)
        answer_parked(self, shard)

    ps = ParameterServer(stores(), "127.0.0.1", SECRET, 1.0, 1 << 20, shared_memory_bytes=1 << 20)
    try:
        with rank_0_waiting(ps) as (_, second, thread, outcome):
            monkeypatch.setattr(ParkedPulls, "answer", late)
            theirs = [w.tolist() for _, w in second.push_pull(0, 4, step_grads(1), 1)]
            thread.join(10)
            assert "error" not in outcome, outcome
            assert [w.tolist() for _, w in outcome["result"]] == theirs
    finally:
        ps.stop()
    assert theirs == trained(0, steps=1)[0]


@pytest.mark.parametrize("shared", [1 << 20, 0], ids=["parked", "waiting"])
def test_stopping_the_server_tells_a_parked_pull_as_it_tells_a_waiting_one(shared):
    ps = serve(shared)
    client = PsClient(ps.endpoint(((0,), (1,))), 0, 0)
    try:
        thread, outcome = in_background(lambda: client.push_pull(0, 3, step_grads(0), 1))
        if shared:
            assert wait_until(lambda: parked(ps) == [1, 1])
        else:
            time.sleep(0.3)
        ps.stop()
        thread.join(10)
        error = outcome.get("error")
        assert isinstance(error, PsTimeoutError), outcome
        assert str(error).startswith("rank 0: the parameter server stopped while pull of clock 1 waited")
    finally:
        client.close()
        ps.stop()


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
def test_a_request_sent_before_reading_the_parked_answer_is_answered_after_it(encrypt, monkeypatch):
    """The parked answer is sent by another thread; the connection's own thread answers the
    next request only once that send is done: one sender at a time, answers in order."""
    senders: dict[int, set[str]] = {}
    overlaps = []
    send_many = Channel.send_many

    def watched(self, messages, wait=True):
        inside = senders.setdefault(id(self), set())
        overlaps.extend(inside)
        inside.add(threading.current_thread().name)
        try:
            if not wait:  # a parked pull's answer: slow, as after losing the GIL
                time.sleep(0.4)
            return send_many(self, messages, wait)
        finally:
            inside.discard(threading.current_thread().name)

    monkeypatch.setattr(Channel, "send_many", watched)
    ps = ParameterServer(
        stores(), "127.0.0.1", SECRET, 10.0, 1 << 20, encrypt=encrypt, shared_memory_bytes=1 << 20
    )
    try:
        (early, mine), (late, theirs) = (granted_channel(ps, rank=rank, encrypt=encrypt) for rank in range(2))
        early.send_many(
            [
                Frame(Kind.PUSH, 0, 0, 0, 0, 3, b"", area=mine, area_bytes=12),
                Frame(Kind.PULL, 0, 0, 0, 1, area=mine),
            ]
        )
        assert wait_until(lambda: parked(ps) == [1, 0])
        late.send(Frame(Kind.PUSH, 0, 1, 0, 0, 3, b"", area=theirs, area_bytes=12))  # completes clock 0
        time.sleep(0.2)  # the parked answer is being sent
        early.send(Frame(Kind.PULL, 0, 0, 0, 1))  # before reading it: the weights in the frame
        answers = [early.recv(1 << 20) for _ in range(3)]
        assert [(a.kind, a.version, a.area) for a in answers] == [
            (Kind.ACK, 0, 0),
            (Kind.WEIGHTS, 1, mine),
            (Kind.WEIGHTS, 1, 0),
        ]
        assert late.recv(1 << 20).kind is Kind.ACK
        assert not overlaps and ps.refusals == {}
    finally:
        ps.stop()


def raced(shared, workers, mode, staleness, encrypt, bf16, steps=60):
    """``workers`` threads push+pull ``steps`` clocks with random pauses; every worker's final
    weights, the refusals, what was left parked and how many parked pulls were answered."""

    def momentum(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    shards = [ShardStore([nn.Parameter(torch.tensor(v))], momentum, mode, workers, staleness) for v in VALUES]
    ps = ParameterServer(
        shards, "127.0.0.1", SECRET, 20.0, 1 << 20, encrypt=encrypt, shared_memory_bytes=shared
    )
    finals: dict[int, list[list[float]]] = {}
    answered = []
    deliver = ps._parked.deliver

    def counted(*args):
        answered.append(args[2].kind)
        deliver(*args)

    ps._parked.deliver = counted  # type: ignore[method-assign]
    try:
        clients = [PsClient(ps.endpoint(((0,), (1,))), rank, 0, bf16_pulls=bf16) for rank in range(workers)]

        def work(rank):
            pauses = np.random.default_rng(rank)
            for step in range(steps):
                if pauses.random() < 0.3:
                    time.sleep(pauses.random() * 0.003)
                clients[rank].push_pull(step, 1 + rank, step_grads(rank, step % 7), step + 1)
            finals[rank] = [w.tolist() for _, w in clients[rank].pull(steps + staleness)]  # every clock in

        try:
            on_threads(work, workers, timeout=60)
        finally:
            for client in clients:
                client.close()
        return finals, ps.refusals, parked(ps), answered
    finally:
        ps.stop()


@pytest.mark.parametrize(
    "workers, mode, staleness, encrypt, bf16",
    [(2, PsMode.SYNC, 0, True, True), (4, PsMode.SYNC, 0, False, False), (3, PsMode.SSP, 2, True, False)],
    ids=["2 sync encrypted bf16", "4 sync", "3 ssp encrypted"],
)
def test_workers_racing_through_parked_pulls_end_with_the_sockets_weights(
    workers, mode, staleness, encrypt, bf16
):
    finals, refusals, left, answered = raced(1 << 20, workers, mode, staleness, encrypt, bf16)
    by_socket, _, _, none = raced(0, workers, mode, staleness, encrypt, bf16)
    assert sorted(finals) == list(range(workers)) and refusals == {} and left == [0, 0]
    # sync: one worker of every clock waits for the last; ssp: only one that ran ahead
    assert len(answered) >= (20 if mode is PsMode.SYNC else 1)
    assert set(answered) == {Kind.WEIGHTS} and none == []
    assert all(finals[rank] == finals[0] for rank in finals)
    assert finals[0] != [list(v) for v in VALUES]
    # two workers sum in one order; more sum in arrival order, which differs in the last bits
    tolerance = 0 if workers == 2 else 1e-5
    for shared_shard, socket_shard in zip(finals[0], by_socket[0], strict=True):
        assert np.allclose(shared_shard, socket_shard, rtol=0, atol=tolerance)
