"""Parameter server: pure store rules, and the real server on loopback sockets."""

from __future__ import annotations

import dataclasses
import pickle
import socket
import struct
import threading
import time

import pytest
import torch
from torch import nn

from sparkdl.errors import CheckpointError, ConnectionClosed, ParameterServerError, PeerStopped, PsAborted
from sparkdl.services.ps.client import PsClient
from sparkdl.services.ps.factored import FACTORS
from sparkdl.services.ps.protocol import PS_WIRE, ErrorCode, Frame, Kind, client_hello
from sparkdl.services.ps.server import ParameterServer, _all_finite
from sparkdl.services.ps.sharding import shard_count, split_into_shards
from sparkdl.services.ps.store import (
    PsMode,
    PsTimeoutError,
    PushRejected,
    ShardStore,
)
from sparkdl.wire.framing import CHALLENGE

SECRET = b"k" * 32


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def store(mode=PsMode.SYNC, workers=2, staleness=0, values=(1.0, 2.0, 3.0)):
    param = nn.Parameter(torch.tensor(values))
    return ShardStore([param], sgd, mode, workers, staleness)


def test_sync_applies_the_row_weighted_mean_once_all_workers_pushed():
    s = store()
    s.push(0, 0, 0, rows=3, grad_sum=torch.tensor([3.0, 3.0, 3.0]))  # mean grad 1
    assert s.version == 0
    s.push(1, 0, 0, rows=1, grad_sum=torch.tensor([5.0, 5.0, 5.0]))  # mean grad 5
    assert s.version == 1
    # (3 + 5) / 4 rows = 2 per element; lr 0.5
    assert s.flat_weights().tolist() == [0.0, 1.0, 2.0]


def test_sync_pull_waits_for_the_clock_and_times_out_naming_the_straggler():
    s = store()
    assert s.pull(0, 0, timeout_s=0.1)[0] == 0
    s.push(0, 0, 0, 1, torch.ones(3))
    started = time.monotonic()
    with pytest.raises(
        PsTimeoutError, match=r"rank 0: pull of clock 1 waited 0s for worker\(s\) \[1\].*ps_timeout_s"
    ) as raised:
        s.pull(0, 1, timeout_s=0.3)
    assert 0.25 < time.monotonic() - started < 2
    assert (raised.value.setting, raised.value.limit_s) == ("parameter_server.ps_timeout_s", 0.3)
    releaser = threading.Timer(0.2, lambda: s.push(1, 0, 0, 1, torch.ones(3)))
    releaser.start()
    version, _ = s.pull(0, 1, timeout_s=5)
    assert version == 1


def test_try_pull_answers_once_the_clock_is_applied_and_never_waits():
    s = store()
    assert s.try_pull(0, 0)[0] == 0
    started = time.monotonic()
    assert s.try_pull(0, 1) is None
    s.push(0, 0, 0, 1, torch.ones(3))
    assert s.try_pull(0, 1) is None
    assert time.monotonic() - started < 0.5
    out = torch.empty(3)
    s.push(1, 0, 0, 1, torch.ones(3))
    version, weights = s.try_pull(0, 1, out)
    assert version == 1 and weights.tolist() == [0.5, 1.5, 2.5] and weights.data_ptr() == out.data_ptr()
    s.push(0, 0, 1, 1, torch.ones(3))
    assert "rank 0: pull of clock 2 waited 7s for worker(s) [1] (next clocks [1]) to push clock 1" in str(
        s.pull_timeout(0, 2, 7.0)
    )
    s.abort("rank 1 stopped: its loss was nan")
    with pytest.raises(PsAborted, match="its loss was nan"):
        s.try_pull(0, 1)


def test_ssp_lets_a_worker_run_staleness_clocks_ahead_but_no_further():
    s = store(PsMode.SSP, staleness=2)
    for clock in range(3):  # rank 0 runs ahead, rank 1 never pushes
        s.push(0, 0, clock, 1, torch.ones(3))
        if clock + 1 <= 2:
            s.pull(0, clock + 1, timeout_s=0.1)  # within the bound: no wait
    with pytest.raises(PsTimeoutError, match=r"worker\(s\) \[1\]"):
        s.pull(0, 3, timeout_s=0.2)  # 3 clocks ahead of the slowest: waits


def test_async_applies_each_push_and_never_blocks_on_a_dead_worker():
    s = store(PsMode.ASYNC)
    for _ in range(20):
        version, _ = s.pull(0, 0, timeout_s=0.01)
        staleness = s.push(0, 0, version, 2, torch.full((3,), 2.0))
        assert staleness == 0
    assert s.version == 20  # rank 1 never pushed; rank 0 was never blocked
    assert s.push(1, 0, 0, 1, torch.ones(3)) == 20  # a push computed on version 0 is 20 stale


def test_pushes_from_old_attempts_duplicates_and_wrong_shapes_are_rejected():
    s = store()
    s.push(0, 0, 0, 1, torch.ones(3))
    with pytest.raises(PushRejected, match="duplicate"):
        s.push(0, 0, 0, 1, torch.ones(3))
    with pytest.raises(PushRejected, match="float32"):
        s.push(1, 0, 0, 1, torch.ones(4))
    with pytest.raises(PushRejected, match="float32"):
        s.push(1, 0, 0, 1, torch.ones(3, dtype=torch.float64))
    s.begin_attempt(1)  # a re-run stage connects: same weights, clocks restart
    with pytest.raises(PushRejected, match="attempt 0; the current attempt is 1"):
        s.push(1, 0, 0, 1, torch.ones(3))
    s.push(0, 1, 0, 1, torch.ones(3))
    s.push(1, 1, 0, 1, torch.ones(3))
    assert s.version == 1


def momentum_store(workers=2):
    param = nn.Parameter(torch.tensor([1.0, 2.0]))
    return ShardStore([param], lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9), PsMode.SYNC, workers)


def sync_steps(s, clocks, grad=1.0):
    for clock in clocks:
        for rank in range(s.num_workers):
            s.push(rank, s.attempt, clock, 1, torch.full((s.numel,), grad * (clock + 1)))


def test_a_resumed_attempt_restores_the_snapshot_and_counts_clocks_from_the_resume_step():
    s = momentum_store()
    sync_steps(s, range(3))
    snap = s.snapshot()  # version 3, with momentum buffers
    sync_steps(s, range(3, 5))  # two more steps, lost with the failed attempt
    s.begin_attempt(1, start_clock=3, state=snap)
    assert s.version == 3
    assert s.pull(0, 3, timeout_s=0.01)[0] == 3  # clock 3 needs no new update
    with pytest.raises(PsTimeoutError, match="to push clock 3"):
        s.pull(0, 4, timeout_s=0.05)
    with pytest.raises(PushRejected, match="pushed clock 0, expected 3"):
        s.push(0, 1, 0, 1, torch.ones(2))
    sync_steps(s, range(3, 5))

    reference = momentum_store()  # the same five steps with no failure
    sync_steps(reference, range(5))
    assert s.version == reference.version == 5
    assert torch.equal(s.flat_weights(), reference.flat_weights())  # momentum came back too


def test_a_snapshot_of_another_layout_is_refused():
    with pytest.raises(PushRejected, match=r"shapes \[\(3,\)\].*ps_shards"):
        momentum_store().begin_attempt(1, start_clock=2, state=store().snapshot())


def test_shards_are_balanced_whole_tensors():
    params = [nn.Parameter(torch.zeros(n)) for n in (100, 10, 60, 50, 5)]
    groups = split_into_shards(params, 2)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4]
    sizes = [sum(params[i].numel() for i in g) for g in groups]
    assert max(sizes) - min(sizes) <= 15


# --- the real server on loopback ------------------------------------------------------


@pytest.fixture
def server():
    stores = [store(values=(1.0, 2.0)), store(values=(3.0, 4.0, 5.0, 6.0))]
    ps = ParameterServer(stores, "127.0.0.1", SECRET, timeout_s=2.0, max_payload=1 << 20)
    yield ps
    ps.stop()
    assert not any(t.name.startswith("sparkdl-ps") and t.is_alive() for t in threading.enumerate())


def endpoint(ps, secret=SECRET):
    return dataclasses.replace(ps.endpoint(((0,), (0,))), secret=secret)


def real_workers_still_train(ps):
    clients = [PsClient(endpoint(ps), rank, 0) for rank in range(2)]
    try:
        for c in clients:
            c.push(0, 1, [torch.ones(2), torch.ones(4)])
        version, weights = clients[0].pull(1)[1]
        assert version == 1 and weights.tolist() == [2.5, 3.5, 4.5, 5.5]
    finally:
        for c in clients:
            c.close()


def raw_connection(ps):
    return socket.create_connection((ps.host, ps.port), timeout=5)


def assert_closed_after_challenge(sock):
    """The server sent its challenge and nothing else, then closed the connection."""
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    assert len(received) == CHALLENGE.size and received.startswith(b"SDNT")


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not condition():
        time.sleep(0.01)
    return condition()


def header(frame, length):
    """The header of ``frame`` announcing ``length`` payload bytes."""
    kind, fields, _ = PS_WIRE.encode(frame)
    return PS_WIRE.pack(kind, fields, length)


def test_a_client_with_the_wrong_secret_is_refused_and_logged(server, caplog):
    with pytest.raises(ParameterServerError, match="connection failed"):
        PsClient(endpoint(server, secret=b"x" * 32), 0, 0)
    assert server.refusals == {"HELLO refused": 1}
    assert "HELLO failed authentication" in caplog.text
    real_workers_still_train(server)


def test_no_credentials_truncated_and_oversized_frames_are_refused(server):
    hello_size = PS_WIRE.hello_size
    with raw_connection(server) as sock:  # no HELLO, just bytes
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\0" * hello_size)
        assert_closed_after_challenge(sock)
    with raw_connection(server) as sock:  # a truncated HELLO, then the peer goes away
        sock.sendall(header(Frame(Kind.HELLO), 16) + b"n" * 16 + b"tag")
        sock.shutdown(socket.SHUT_WR)
        assert_closed_after_challenge(sock)
    with raw_connection(server) as sock:  # a "HELLO" announcing 1 GiB of payload
        sock.sendall(header(Frame(Kind.PUSH), 1 << 30).ljust(hello_size, b"\0"))
        assert_closed_after_challenge(sock)
    with raw_connection(server) as sock:  # an authenticated frame over the largest shard
        channel = client_hello(sock, SECRET, rank=0, attempt=0, server_key=server.public_key)
        assert channel.recv(1 << 20).kind is Kind.ACK
        channel.send(Frame(Kind.PUSH, shard=0, rank=0, rows=1, payload=b"\0" * 9000))
        with pytest.raises(ConnectionClosed):
            channel.recv(1 << 20)
    assert wait_until(lambda: sum(server.refusals.values()) == 4)
    assert server.refusals == {"HELLO refused": 2, "closed before its HELLO": 1, "frame refused": 1}
    real_workers_still_train(server)


def test_a_pickled_payload_is_never_unpickled(server):
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled!')",))

    with raw_connection(server) as sock:
        channel = client_hello(sock, SECRET, rank=0, attempt=0, server_key=server.public_key)
        assert channel.recv(1 << 20).kind is Kind.ACK
        channel.send(Frame(Kind.PUSH, shard=0, rank=0, rows=1, payload=pickle.dumps(Boom())))
        reply = channel.recv(1 << 20)
    assert reply.kind is Kind.ERROR and reply.error is ErrorCode.REJECTED
    assert b"takes 8 bytes of float32" in bytes(reply.payload)
    real_workers_still_train(server)


def test_a_stuck_sync_pull_fails_with_the_workers_waited_for(server):
    client = PsClient(endpoint(server), 0, 0)
    try:
        client.push(0, 1, [torch.ones(2), torch.ones(4)])
        started = time.monotonic()
        with pytest.raises(PsTimeoutError, match=r"waited 2s for worker\(s\) \[1\]"):
            client.pull(1)
        assert time.monotonic() - started < 5
    finally:
        client.close()


def test_a_stopped_worker_stops_its_peers_and_an_old_attempt_is_rejected_by_typed_errors(server):
    clients = [PsClient(endpoint(server), rank, 1) for rank in range(2)]
    try:
        with pytest.raises(PushRejected, match="stage attempt 0 is older than the current 1"):
            PsClient(endpoint(server), 0, 0)
        clients[0].abort("its loss was nan")
        with pytest.raises(PeerStopped, match=r"^rank 1: rank 0 stopped: its loss was nan$") as raised:
            clients[1].pull(0)
        assert raised.value.agreed_by_all_ranks
    finally:
        for c in clients:
            c.close()


def test_spark_connect_sessions_are_told_which_strategies_work():
    from sparkdl import ClusterConfigError
    from sparkdl.spark.ps_host import start_parameter_server

    # A stand-in whose type lives where Spark Connect's session class lives: the check
    # looks only at that, and must fire before anything else is touched.
    connect_session = type("SparkSession", (), {"__module__": "pyspark.sql.connect.session"})()
    with pytest.raises(ClusterConfigError, match="use strategy 'allreduce' or 'weight_averaging'"):
        start_parameter_server(connect_session, spec=None)  # type: ignore[arg-type]


def test_a_new_server_resumes_from_the_snapshots_written_through_the_old_one(tmp_path):
    """An application crash: a fresh server (new secret, version 0) picks up at the snapshot."""

    def serve():
        return ParameterServer(
            [momentum_store(), momentum_store()], "127.0.0.1", SECRET, 2.0, 1 << 20, str(tmp_path)
        )

    def train(ps, attempt, clocks, start=0):
        clients = [PsClient(endpoint(ps), rank, attempt, start) for rank in range(2)]
        try:
            for clock in clocks:
                for c in clients:
                    c.push(clock, 1, [torch.full((2,), clock + 1.0)] * 2)
                if clock == 1:  # rank 0 checkpoints at step 2
                    assert clients[0].snapshot(2) == [2, 2]
            return clients[0].pull(clocks[-1] + 1)
        finally:
            for c in clients:
                c.close()

    first = serve()
    train(first, 0, [0, 1, 2, 3])
    first.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ps-shard-000-000000002.pt",
        "ps-shard-001-000000002.pt",
    ]
    second = serve()
    try:
        with pytest.raises(CheckpointError, match="no snapshot of it"):
            PsClient(endpoint(second), 0, 5, start_clock=3)  # a step that was never snapshotted
        resumed = train(second, 6, [2, 3], start=2)
    finally:
        second.stop()
    clean = serve()
    try:
        expected = train(clean, 0, [0, 1, 2, 3])
    finally:
        clean.stop()
    assert [v for v, _ in resumed] == [v for v, _ in expected] == [4, 4]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(resumed, expected, strict=True))


# --- backup workers (sync): the first N - b pushes of a clock make the step -----------------


def test_with_a_backup_worker_a_clock_is_applied_without_the_slowest_and_its_push_is_dropped():
    param = nn.Parameter(torch.tensor([1.0, 2.0]))
    s = ShardStore([param], sgd, PsMode.SYNC, 3, backup_workers=1)
    s.push(0, 0, 0, rows=1, grad_sum=torch.tensor([2.0, 2.0]))
    assert s.version == 0  # one of the two needed
    s.push(2, 0, 0, rows=3, grad_sum=torch.tensor([6.0, 6.0]))
    assert s.version == 1 and s.flat_weights().tolist() == [0.0, 1.0]  # (2 + 6) / 4 rows, lr 0.5
    assert s.push(1, 0, 0, rows=5, grad_sum=torch.tensor([100.0, 100.0])) == 1  # one clock late
    assert s.dropped == 1 and s.version == 1 and s.flat_weights().tolist() == [0.0, 1.0]
    assert s.ahead_of(0) == 1 and s.ahead_of(1) == 0  # what a pull tells the late worker


def test_a_backup_worker_that_skipped_ahead_may_push_a_later_clock_but_never_an_old_one_twice():
    s = ShardStore([nn.Parameter(torch.zeros(2))], sgd, PsMode.SYNC, 2, backup_workers=1)
    for clock in range(3):  # rank 0 alone makes clocks 0, 1, 2
        s.push(0, 0, clock, 1, torch.ones(2))
    assert s.version == 3 and s.ahead_of(0) == 3
    s.push(1, 0, 3, 1, torch.ones(2))  # rank 1 skipped clocks 0-2: accepted, and it makes clock 3
    assert s.version == 4
    with pytest.raises(PushRejected, match="pushed clock 2, expected 4"):
        s.push(1, 0, 2, 1, torch.ones(2))


def test_without_backup_workers_nothing_is_dropped_and_no_pull_is_told_to_skip():
    s = store(workers=2)
    s.push(0, 0, 0, 1, torch.ones(3))
    assert s.ahead_of(0) == 0 and s.dropped == 0
    with pytest.raises(PushRejected, match="pushed clock 2, expected 1"):
        s.push(0, 0, 2, 1, torch.ones(3))
    with pytest.raises(ValueError, match="backup_workers = 2 must be >= 0 and < the 2 workers"):
        ShardStore([nn.Parameter(torch.zeros(1))], sgd, PsMode.SYNC, 2, backup_workers=2)


def test_push_pull_sends_the_pull_behind_the_push_and_gets_the_applied_weights(server):
    clients = [PsClient(endpoint(server), rank, 0) for rank in range(2)]
    results = {}

    def step(rank):
        results[rank] = clients[rank].push_pull(0, 1, [torch.ones(2), torch.full((4,), float(rank))], 1)

    try:
        threads = [threading.Thread(target=step, args=(rank,)) for rank in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        for rank in range(2):  # the sync clock 0 is both pushes: mean gradient 0.5 on shard 1
            (v0, w0), (v1, w1) = results[rank]
            assert (v0, v1) == (1, 1)
            assert w0.tolist() == [0.5, 1.5] and w1.tolist() == [2.75, 3.75, 4.75, 5.75]
            stats = clients[rank].stats
            assert (stats.pushes, stats.pulls, stats.bytes_received) == (1, 1, 4 * 6)
            assert stats.bytes_sent > 4 * 6  # the gradients, the PULLs and every frame's header
    finally:
        for c in clients:
            c.close()


def test_a_rejected_push_fails_push_pull_at_once_without_waiting_for_its_pull(server):
    client = PsClient(endpoint(server), 0, 0)
    try:
        started = time.monotonic()
        with pytest.raises(ParameterServerError, match="push of 12 bytes to shard 0"):
            client.push_pull(0, 1, [torch.ones(3), torch.ones(4)], 1)  # shard 0 holds 2 values
        assert time.monotonic() - started < server.timeout_s  # the pull behind it would wait 2 s
    finally:
        client.close()


def test_a_gradient_is_finite_exactly_when_every_value_is_even_where_its_float32_sum_overflows():
    assert _all_finite(torch.full((4,), 3e38))  # the sum is inf; every value is finite
    assert _all_finite(torch.zeros(0))
    for bad in (float("nan"), float("inf"), float("-inf")):
        values = torch.full((1000,), 3e38)
        values[517] = bad
        assert not _all_finite(values)


def test_the_server_runs_torch_on_one_thread_and_gives_the_drivers_setting_back():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        servers = [ParameterServer([store()], "127.0.0.1", SECRET, 2.0, 1 << 20) for _ in range(2)]
        assert torch.get_num_threads() == 1
        servers[0].stop()
        assert torch.get_num_threads() == 1  # the other server still runs
        servers[1].stop()
        servers[1].stop()  # twice: still restored once
        assert torch.get_num_threads() == 2
        kept = ParameterServer([store()], "127.0.0.1", SECRET, 2.0, 1 << 20, torch_threads=0)
        assert torch.get_num_threads() == 2
        kept.stop()
    finally:
        torch.set_num_threads(before)


def test_auto_shards_give_a_small_model_one_shard_and_a_large_one_up_to_four():
    def params(*sizes):
        return [nn.Parameter(torch.empty(n, device="meta")) for n in sizes]

    small = params(64 * 256, 256, 256 * 256, 256, 256 * 10, 10)  # the benchmark MLP: 340 KB
    assert shard_count(small, 0) == 1
    assert shard_count(params(*[1_000_000] * 10), 0) == 2  # 40 MB
    assert shard_count(params(*[10_000_000] * 10), 0) == 4  # 400 MB: at most 4
    assert shard_count(small, 3) == 3  # an explicit count is kept
    assert len(split_into_shards(small, shard_count(small, 0))) == 1


def test_a_single_shard_client_works_without_its_pool():
    one = ParameterServer([store(values=(1.0, 2.0))], "127.0.0.1", SECRET, timeout_s=2.0, max_payload=1 << 20)
    e = one.endpoint(((0,),))
    clients = [PsClient(e, rank, 0) for rank in range(2)]
    try:
        clients[0].push(0, 1, [torch.ones(2)])
        ((version, weights),) = clients[1].push_pull(0, 3, [torch.full((2,), 5.0)], 1)
        assert version == 1 and weights.tolist() == [0.25, 1.25]  # sums 1 + 5 over 4 rows: lr 0.5 x 1.5
    finally:
        for c in clients:
            c.close()
        one.stop()


def test_an_attempt_pushes_through_the_pushers_its_hello_says_and_its_connections_must_agree():
    ps = ParameterServer([store(workers=4)], "127.0.0.1", SECRET, timeout_s=2.0, max_payload=1 << 20)
    e = ps.endpoint(((0,),))
    leaders = [PsClient(e, host, 0, pushers=2) for host in range(2)]  # 4 workers on 2 hosts
    try:
        for host, leader in enumerate(leaders):  # each leader pushes its host's sum of 2 rows
            leader.push(0, 2, [torch.full((3,), float(host))])
        ((version, weights),) = leaders[0].pull(1)
        assert version == 1 and weights.tolist() == [0.875, 1.875, 2.875]  # lr 0.5 x (0 + 1) / 4 rows
        with pytest.raises(ParameterServerError, match="says 0 pushers, its first said 2"):
            PsClient(e, 0, 0)  # a flat worker of the same attempt
        with pytest.raises(ParameterServerError, match="1 to 4"):
            PsClient(e, 0, 1, pushers=5)  # a newer attempt with more pushers than workers
    finally:
        for leader in leaders:
            leader.close()
        ps.stop()


def test_bf16_pulls_carry_half_the_bytes_and_the_servers_weights_rounded_to_bf16():
    values = (1.0 + 2**-10, -3.0 + 2**-12, 1e30, 7.0)  # the first two are not bf16 numbers
    ps = ParameterServer([store(values=values)], "127.0.0.1", SECRET, timeout_s=2.0, max_payload=1 << 20)
    try:
        e = ps.endpoint(((0,),))
        half = PsClient(e, 0, 0, bf16_pulls=True)
        full = PsClient(e, 1, 0)
        try:
            ((version, pulled),) = half.pull(0)
            expected = torch.tensor(values).to(torch.bfloat16).float()
            assert version == 0 and pulled.dtype == torch.float32
            assert pulled.tolist() == expected.tolist() and pulled.tolist() != list(values)
            assert half.stats.bytes_received == 2 * len(values)
            assert full.pull(0)[0][1].tolist() == torch.tensor(values).tolist()  # the server keeps float32
            assert full.stats.bytes_received == 4 * len(values)
        finally:
            half.close()
            full.close()
    finally:
        ps.stop()


def test_a_pull_in_an_encoding_the_server_does_not_serve_closes_the_connection(server, caplog):
    channel = client_hello(raw_connection(server), SECRET, 0, 0, 0, server_key=server.public_key)
    try:
        assert channel.recv(1 << 20).kind is Kind.ACK  # of the HELLO
        channel.send(Frame(Kind.PULL, 0, 0, 0, 0, dtype=2))  # 1-bit weights: not a thing
        with pytest.raises(ConnectionClosed):
            channel.recv(1 << 20)
    finally:
        channel.sock.close()
    assert "pull of shard 0 in encoding 2: fp32 or bf16 only" in caplog.text
    real_workers_still_train(server)


@pytest.mark.parametrize("index", [4, -1, 2**31 - 1], ids=["past the end", "negative", "huge"])
def test_a_top_k_push_with_an_index_outside_its_shard_is_rejected_and_the_connection_lives(server, index):
    """Before, an index past the end killed the connection's thread with an IndexError, and a
    negative one was applied to a value counted from the end."""
    channel = client_hello(raw_connection(server), SECRET, 0, 0, 0, server_key=server.public_key)
    try:
        assert channel.recv(1 << 20).kind is Kind.ACK
        payload = struct.pack("<if", index, 1.0)  # shard 1 holds 4 values: top-k keeps 1
        channel.send(Frame(Kind.PUSH, 1, 0, 0, 0, 1, payload, dtype=3))  # 3: the top-k codec
        reply = channel.recv(1 << 20)
        assert reply.kind is Kind.ERROR and reply.error is ErrorCode.REJECTED
        assert "push to shard 1 in topk does not decode: top-k indices" in bytes(reply.payload).decode()
        channel.send(Frame(Kind.PULL, 1, 0, 0, 0))  # the connection still answers
        assert channel.recv(1 << 20).kind is Kind.WEIGHTS
    finally:
        channel.sock.close()
    assert server.stores[1].version == 0 and server.rejected_pushes == 1
    real_workers_still_train(server)


def test_a_push_of_factors_to_a_server_not_started_for_them_is_rejected_and_the_connection_lives(server):
    channel = client_hello(raw_connection(server), SECRET, 0, 0, 0, server_key=server.public_key)
    try:
        assert channel.recv(1 << 20).kind is Kind.ACK
        channel.send(Frame(Kind.PUSH, 1, 0, 0, 0, 1, struct.pack("<i4f", -1, 1, 2, 3, 4), dtype=FACTORS))
        reply = channel.recv(1 << 20)
        assert reply.kind is Kind.ERROR and reply.error is ErrorCode.REJECTED
        assert (
            "carries sufficient factors, which this server was not started to take"
            in bytes(reply.payload).decode()
        )
        channel.send(Frame(Kind.PULL, 1, 0, 0, 0))
        assert channel.recv(1 << 20).kind is Kind.WEIGHTS
    finally:
        channel.sock.close()
