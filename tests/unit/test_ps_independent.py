"""The parameter server's record for independent tasks (``ps_barrier = false``): per
partition, the task attempt whose pushes it takes, the rows it applied, and the settings
that mode refuses. Outside Spark: a store directly, and a real server over its socket."""

from __future__ import annotations

import socket
import time

import pytest
import torch
from torch import nn

from sparkdl.config import PsMode, SparkDLConfig
from sparkdl.errors import ConfigError, ParameterServerError, PsTimeoutError, PushRejected
from sparkdl.services.ps.client import PsClient
from sparkdl.services.ps.server import ParameterServer
from sparkdl.services.ps.store import ShardStore
from sparkdl.spark.independent import run_figures
from sparkdl.strategies import check_settings

SECRET = b"k" * 32


def independent_store(workers: int = 3) -> ShardStore:
    param = nn.Parameter(torch.zeros(4))
    return ShardStore(
        [param], lambda ps: torch.optim.SGD(ps, lr=1.0), PsMode.ASYNC, workers, independent=True
    )


def test_each_partition_counts_the_rows_of_the_pushes_applied():
    s = independent_store()
    assert s.begin_task(0, 0) == 0 and s.begin_task(1, 0) == 0
    s.push(0, 0, 0, 32, torch.ones(4) * 32)
    s.push(0, 0, 1, 32, torch.ones(4) * 32)
    s.push(1, 0, 2, 7, torch.ones(4) * 7)
    assert s.rows_applied == [64, 7, 0]
    assert [len(times) for times in s.push_times] == [2, 1, 0]
    assert torch.equal(s.params[0].detach(), -3 * torch.ones(4))  # three mean-1 gradients, lr 1


def test_a_retried_attempt_fences_its_predecessor_and_learns_the_rows_to_skip():
    s = independent_store()
    s.begin_task(1, 0)
    s.push(1, 0, 0, 10, torch.ones(4) * 10)
    assert s.begin_task(1, 1) == 10  # the retry: skip 10 rows
    with pytest.raises(PushRejected, match=r"task 0 of partition 1.*task 1"):
        s.push(1, 0, 1, 10, torch.ones(4) * 10)  # the zombie's push
    assert s.rows_applied[1] == 10 and s.version == 1
    s.push(1, 1, 1, 5, torch.ones(4) * 5)
    assert s.rows_applied[1] == 15
    with pytest.raises(PushRejected, match="older than task 1"):
        s.begin_task(1, 0)  # a stale attempt cannot take the partition back
    with pytest.raises(PushRejected, match="partition 0"):
        s.push(0, 0, 1, 3, torch.ones(4) * 3)  # partition 0 never said HELLO: no attempt of it is taken


def test_records_are_bounded_by_the_partitions():
    s = independent_store(workers=2)
    with pytest.raises(PushRejected, match="partition 2 is not one of the fit's 2"):
        s.begin_task(2, 0)
    with pytest.raises(PushRejected):
        s.push(5, 0, 0, 1, torch.ones(4))
    s.begin_task(0, 0)
    for clock in range(5000):
        s.push(0, 0, clock, 1, torch.zeros(4))
    assert len(s.push_times[0]) == 4096 and s.rows_applied[0] == 5000


def test_a_barrier_store_takes_no_task_hello_and_independence_is_never_sync():
    with pytest.raises(PushRejected, match="barrier"):
        ShardStore(
            [nn.Parameter(torch.zeros(2))], lambda ps: torch.optim.SGD(ps, lr=1.0), PsMode.ASYNC, 2
        ).begin_task(0, 0)
    with pytest.raises(ValueError, match="this store is sync"):
        ShardStore(
            [nn.Parameter(torch.zeros(2))],
            lambda ps: torch.optim.SGD(ps, lr=1.0),
            PsMode.SYNC,
            2,
            independent=True,
        )


def ssp_store(workers: int = 3, staleness: int = 1) -> ShardStore:
    param = nn.Parameter(torch.zeros(4))
    return ShardStore(
        [param], lambda ps: torch.optim.SGD(ps, lr=1.0), PsMode.SSP, workers, staleness, independent=True
    )


def test_ssp_tasks_wait_only_for_the_slowest_live_partition_and_a_newcomer_holds_nobody_back():
    """Stale-synchronous over independent tasks: each push is applied on arrival; a pull waits
    while its partition is more than ``staleness`` pushes ahead of the slowest live partition.
    A task is live from its first push until it ends: one that ended (failed, finished) or has
    not pushed yet (starting, skipping its predecessor's rows) holds nobody back, and it joins
    at the slowest live clock."""
    s = ssp_store(workers=3, staleness=1)
    s.begin_task(0, 10)
    s.begin_task(1, 11)  # partition 2's task has not started: it counts for nothing
    assert s.try_pull(0, 0) is not None  # nobody has pushed: nobody is waited for
    s.push(1, 11, 0, 4, torch.ones(4) * 4)  # partition 1 joins: clock 1
    s.push(0, 10, 0, 4, torch.ones(4) * 4)  # partition 0 joins at the slowest live clock (1): 2
    s.push(0, 10, 1, 4, torch.ones(4) * 4)
    assert s.version == 3 and s.task_clocks == [3, 1, 0]  # applied as they came
    assert s.try_pull(0, 0) is None  # 2 ahead of partition 1, the slowest live one
    assert s.try_pull(1, 0) is not None  # the slowest never waits
    s.push(1, 11, 2, 4, torch.ones(4) * 4)
    assert s.try_pull(0, 0) is not None  # within 1 of partition 1 now
    s.push(0, 10, 3, 4, torch.ones(4) * 4)
    assert s.try_pull(0, 0) is None
    with pytest.raises(PsTimeoutError, match=r"partition 0.*clock 4.*partition\(s\) \[1\] \(clocks \[2\]\)"):
        s.pull(0, 0, timeout_s=0.05)
    s.end_task(1, 99)  # a fenced or unknown task's end changes nothing
    assert s.try_pull(0, 0) is None
    s.end_task(1, 11)  # partition 1's task failed: partition 0 goes on alone
    assert s.try_pull(0, 0) is not None
    s.push(0, 10, 4, 4, torch.ones(4) * 4)
    s.begin_task(1, 12)  # its retry, still starting, holds nobody back
    s.begin_task(2, 13)  # nor does a task started late
    assert s.try_pull(0, 0) is not None
    s.push(1, 12, 5, 4, torch.ones(4) * 4)  # each joins at the slowest live clock (partition 0's 5)
    s.push(2, 13, 6, 4, torch.ones(4) * 4)
    assert s.task_clocks == [5, 6, 6] and s.try_pull(0, 0) is not None
    assert s.rows_applied == [16, 12, 4]  # rows stay the partition's own: a retry skips what was applied


def test_a_pull_waiting_at_the_bound_is_answered_when_the_slow_task_is_gone():
    """Over the socket: partition 0's pull waits for partition 1. It is answered at once, not
    at the 30 s timeout, when the driver's watch finds Spark no longer runs partition 1's
    task (its connection may be half-open, a host cut off), and again, once that task pushed
    and so is live again, when its connection closes."""
    import threading

    store = ssp_store(workers=2, staleness=0)
    server = ParameterServer([store], "127.0.0.1", SECRET, 30.0, 1 << 20)

    def pull_waits_until(release) -> None:
        answered = []
        waiting = threading.Thread(target=lambda: answered.append(fast.pull(1)))
        started = time.monotonic()
        waiting.start()
        time.sleep(0.3)
        assert not answered  # one push ahead of partition 1, with staleness 0
        release()
        waiting.join(10)
        assert answered and time.monotonic() - started < 5

    try:
        base = server.endpoint(((0,),))
        fast = PsClient(dataclassed(base, partition=0, task_attempt=1), 0, 1)
        slow = PsClient(dataclassed(base, partition=1, task_attempt=2), 1, 2)
        slow.push(0, 4, [torch.ones(4) * 4])  # live from its first push
        fast.push(0, 4, [torch.ones(4) * 4])
        pull_waits_until(lambda: server.task_not_running(1, 2))
        slow.push(1, 4, [torch.ones(4) * 4])  # back: it joins at partition 0's clock (2), then 3
        assert store.task_clocks == [2, 3]
        fast.push(1, 4, [torch.ones(4) * 4])
        fast.push(2, 4, [torch.ones(4) * 4])  # one ahead of partition 1 again
        pull_waits_until(slow.close)
        fast.close()
    finally:
        server.stop()


def test_over_the_socket_a_retry_learns_its_rows_and_the_stale_attempt_is_refused():
    store = independent_store(workers=2)
    server = ParameterServer([store], "127.0.0.1", SECRET, 5.0, 1 << 20)
    try:
        base = server.endpoint(((0,),))
        first = PsClient(dataclassed(base, partition=1, task_attempt=0), 1, 0)
        assert first.rows_done == 0
        first.push(0, 12, [torch.ones(4) * 12])
        retry = PsClient(dataclassed(base, partition=1, task_attempt=1), 1, 1)
        assert retry.rows_done == 12
        with pytest.raises(ParameterServerError, match="task 0 of partition 1"):
            first.push(1, 12, [torch.ones(4) * 12])
        retry.push(1, 4, [torch.ones(4) * 4])
        ledger = server.task_ledger()
        assert ledger["rows_applied"] == [0, 16]
        takeovers = [
            (t["partition"], t["task_id"], t["replaced_task_id"], t["rows_skipped"])
            for t in ledger["takeovers"]
        ]
        assert takeovers == [(1, 1, 0, 12)]
        assert set(server.task_silence()) == {1}  # partition 1's connections are open
        assert server.current_task(1) == 1 and server.current_task(0) == -1
        # the server probes every session's peer (a host cut off sends no FIN)
        assert all(
            s.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) for s in server._listener._sessions
        )
        retry.close()
        # the fenced task's connection is still open, but it is no longer the partition's
        deadline = time.monotonic() + 5
        while server.task_silence() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.task_silence() == {}
        first.close()
        figures = run_figures(server.task_ledger())
        assert figures["partition_pushes"] == [0, 2] and figures["partition_rows_applied"] == [0, 16]
    finally:
        server.stop()


def dataclassed(endpoint, **changes):
    import dataclasses

    return dataclasses.replace(endpoint, **changes)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"ps_mode": "sync"}, "ps_mode = 'sync'"),
        ({"ps_shards": 2}, "ps_shards = 2"),
        ({"early_stopping_patience": 2}, "early_stopping_patience = 2"),
        ({"validation_fraction": 0.1}, "validation rows"),
    ],
)
def test_settings_that_need_the_workers_to_meet_are_refused_with_the_fix(changes, named):
    base = {"strategy": "parameter_server", "ps_mode": "async", "ps_barrier": False, "num_workers": 2}
    with pytest.raises(ConfigError, match="ps_barrier = false") as refused:
        check_settings(SparkDLConfig().replace(**{**base, **changes}))
    assert named in str(refused.value) and "ps_barrier = true" in str(refused.value)


def test_other_strategies_refuse_it_and_async_and_ssp_take_it():
    with pytest.raises(ConfigError, match=r"only the asynchronous \(or stale-synchronous\) parameter server"):
        check_settings(SparkDLConfig().replace(**{"strategy": "allreduce", "ps_barrier": False}))
    check_settings(SparkDLConfig().replace(strategy="parameter_server", ps_mode="async", ps_barrier=False))
    check_settings(SparkDLConfig().replace(strategy="parameter_server", ps_mode="ssp", ps_barrier=False))


def test_a_newer_task_is_believed_only_when_spark_runs_it_for_that_partition():
    """A holder of the secret claiming a huge task id (or a real one of another partition)
    cannot fence a partition's running task out: the server asks Spark's status store."""
    store = independent_store(workers=2)
    running = {(1, 7), (1, 9), (0, 8)}  # (partition, task id) Spark's status store lists
    asked = []

    def task_started(partition, task_id):
        asked.append((partition, task_id))
        return (partition, task_id) in running

    server = ParameterServer([store], "127.0.0.1", SECRET, 5.0, 1 << 20, task_started=task_started)
    try:
        base = server.endpoint(((0,),))
        task = PsClient(dataclassed(base, partition=1, task_attempt=7), 1, 7)
        task.push(0, 4, [torch.ones(4)])
        for claimed in (1 << 31, 8):  # an id Spark never gave; partition 0's task
            with pytest.raises(ParameterServerError, match=f"claims task {claimed} of partition 1"):
                PsClient(dataclassed(base, partition=1, task_attempt=claimed), 1, claimed)
        task.push(1, 4, [torch.ones(4)])  # still the partition's task: its pushes are taken
        assert store.rows_applied == [0, 8] and server.task_ledger()["takeovers"] == []
        retry = PsClient(dataclassed(base, partition=1, task_attempt=9), 1, 9)  # Spark's real retry
        assert retry.rows_done == 8
        assert asked == [(1, 7), (1, 1 << 31), (1, 8), (1, 9)]  # asked once per newer task, never per push
        task.close()
        retry.close()
        # the current task's id claimed again once it has no connection (it ended): asked too
        deadline = time.monotonic() + 5
        while server.task_silence() and time.monotonic() < deadline:
            time.sleep(0.02)
        running.discard((1, 9))
        with pytest.raises(ParameterServerError, match="claims task 9 of partition 1"):
            PsClient(dataclassed(base, partition=1, task_attempt=9), 1, 9)
        assert asked[-1] == (1, 9)
    finally:
        server.stop()


def test_rows_of_dropped_steps_count_as_covered_so_a_retry_skips_them_too():
    """A step dropped for a non-finite loss trains nothing, but its rows were read: the
    partition's count includes them, or a retry would stop skipping one step early and train
    its predecessor's last pushed step twice."""
    store = independent_store(workers=2)
    server = ParameterServer([store], "127.0.0.1", SECRET, 5.0, 1 << 20)
    try:
        base = server.endpoint(((0,),))
        task = PsClient(dataclassed(base, partition=0, task_attempt=3), 0, 3)
        task.rows_dropped = 8  # one step of 8 rows dropped, then one of 4 trained
        task.push(0, 4, [torch.ones(4) * 4])
        assert store.rows_applied == [12, 0] and store.version == 1 and task.rows_dropped == 0
        task.rows_dropped = 8  # a push of dropped rows alone: counted, nothing applied
        task.push(1, 0, [torch.zeros(4)])
        assert store.rows_applied == [20, 0] and store.version == 1
        assert torch.equal(store.params[0].detach(), -torch.ones(4))  # the one mean-1 gradient, lr 1
        retry = PsClient(dataclassed(base, partition=0, task_attempt=4), 0, 4)
        assert retry.rows_done == 20
        task.close()
        retry.close()
    finally:
        server.stop()


def test_the_drivers_snapshot_brings_a_new_server_back_with_each_partitions_rows(tmp_path):
    """The application died: a new fit's server (a new store) restores the newest snapshot,
    weights, Adam's state, version and each partition's rows, and a task skips those rows."""
    from sparkdl.errors import CheckpointError
    from sparkdl.services.ps.task_snapshots import TaskSnapshots

    def adam_store(workers=2):
        param = nn.Parameter(torch.zeros(4))
        return ShardStore(
            [param], lambda ps: torch.optim.Adam(ps, lr=0.1), PsMode.ASYNC, workers, independent=True
        )

    first = adam_store()
    snapshots = TaskSnapshots(first, str(tmp_path), every_versions=2)
    assert snapshots.restore() is None  # nothing there: a fresh start
    first.begin_task(0, 0)
    first.begin_task(1, 0)
    for clock, (rank, rows) in enumerate([(0, 8), (1, 8), (0, 5)]):
        first.push(rank, 0, clock, rows, torch.ones(4) * rows)
    assert snapshots.close() == 3  # the last one, at the fit's end
    second = adam_store()
    assert TaskSnapshots(second, str(tmp_path)).restore() == {"version": 3, "rows_applied": [13, 8]}
    assert torch.equal(second.params[0].detach(), first.params[0].detach())
    state, expected = second.optimizer.state_dict()["state"][0], first.optimizer.state_dict()["state"][0]
    assert torch.equal(state["exp_avg"], expected["exp_avg"]) and state["step"] == expected["step"]
    assert second.begin_task(0, 0) == 13  # its task skips them
    with pytest.raises(CheckpointError, match="rows of 2 partitions, this fit has 3"):
        TaskSnapshots(adam_store(workers=3), str(tmp_path)).restore()


def test_snapshots_are_written_every_so_many_updates_while_the_fit_runs(tmp_path):
    from sparkdl.services.ps.task_snapshots import TaskSnapshots

    store = independent_store(workers=1)
    snapshots = TaskSnapshots(store, str(tmp_path), every_versions=3)
    snapshots.watch(poll_s=0.01)
    store.begin_task(0, 0)
    try:
        for clock in range(7):
            store.push(0, 0, clock, 1, torch.ones(4))
            time.sleep(0.05)  # the watcher looks every 0.01 s
    finally:
        snapshots.close()
    files = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".pt")
    assert files == ["ps-tasks-000000006.pt", "ps-tasks-000000007.pt"]  # 3, 6 and the last; two kept


def test_an_independent_tasks_device_record_names_the_address_it_reaches_the_driver_from():
    """An independent task's process group of one binds loopback; its device record names the
    executor by the address it reaches the driver from, as a barrier worker's does."""
    from sparkdl.comm.network_interfaces import interface_addresses
    from sparkdl.spark.independent_task import executor_address

    assert executor_address("127.0.0.1") == "127.0.0.1"
    assert executor_address("no-such-host.invalid") == "127.0.0.1"  # no route: loopback, no error
    for addresses in interface_addresses().values():
        for address in addresses:  # the driver on one of this machine's own addresses: that one
            assert executor_address(str(address)) == str(address)


def test_the_lr_schedule_counts_a_version_per_push_wherever_each_push_is_a_version():
    """Where every push is an update (async, and independent tasks under ssp too), N workers
    make N versions per push interval: the schedule's global step is version * interval / N,
    not the version (which ran warm-up and decay N times too fast under independent ssp)."""
    from sparkdl.spark.ps_host import _steps_per_version

    def config(**settings):
        return SparkDLConfig().replace(strategy="parameter_server", num_workers=4, **settings)

    assert _steps_per_version(config(ps_mode="ssp")) == 1.0  # a barrier clock: every worker's push
    assert _steps_per_version(config(ps_mode="sync")) == 1.0
    assert _steps_per_version(config(ps_mode="ssp", ps_barrier=False, push_every=3)) == 0.25
    assert _steps_per_version(config(ps_mode="async", push_every=2)) == 0.5
    assert _steps_per_version(config(ps_mode="async", ps_barrier=False, push_every=2)) == 0.5
