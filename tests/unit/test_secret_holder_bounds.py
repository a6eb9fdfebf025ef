"""What one peer holding the fit's secret can make the driver hold or do, bounded (issue 53
item 5): the parameter server's pending clocks and its weights, and the lines a worker has
the driver log. Real servers and clients on loopback; the weights server's bounds are in
test_weights.py."""

from __future__ import annotations

import logging
import math
import time

import pytest
import torch
from torch import nn

from sparkdl.errors import PushRejected
from sparkdl.services.progress.board import ProgressBoard
from sparkdl.services.progress.channel import ProgressReporter, ProgressServer
from sparkdl.services.ps.client import PsClient
from sparkdl.services.ps.server import ParameterServer
from sparkdl.services.ps.store import PsMode, ShardStore
from sparkdl.services.worker_lines import BURST, PER_S, SAY_EVERY_S, WorkerLines

SECRET = b"s" * 32


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not condition():
        time.sleep(0.01)
    return condition()


def serve(values, mode, workers, staleness=0, backup_workers=0):
    store = ShardStore(
        [nn.Parameter(torch.tensor(values))],
        lambda params: torch.optim.SGD(params, lr=0.5),
        mode,
        workers,
        staleness,
        backup_workers=backup_workers,
    )
    return ParameterServer([store], "127.0.0.1", SECRET, timeout_s=5.0, max_payload=1 << 24)


def client(ps, rank):
    return PsClient(ps.endpoint(((0,),)), rank, 0)


# --- pending clocks -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "staleness", "backup_workers", "clocks", "kept"),
    [
        (PsMode.SYNC, 0, 1, range(0, 400, 10), 1),  # a backup worker may skip ahead: it did unbounded
        (PsMode.SYNC, 0, 0, range(40), 1),
        (PsMode.SSP, 2, 0, range(40), 3),
    ],
)
def test_a_push_too_far_ahead_of_the_applied_clock_is_refused_and_not_kept(
    mode, staleness, backup_workers, clocks, kept
):
    """Before, one rank pushing clocks ahead without ever pulling had each kept as a pending
    gradient sum (40 pushes of a 1M-value shard: +164 MB); now a push is kept only within
    ``staleness`` clocks of the next one to be applied, as an honest worker's always is."""
    ps = serve([0.0] * 1_000_000, mode, workers=3, staleness=staleness, backup_workers=backup_workers)
    attacker = client(ps, 0)
    try:
        refused = []
        for clock in clocks:
            try:
                attacker.push(clock, 1, [torch.ones(1_000_000)])
            except PushRejected as exc:
                refused.append(str(exc))
                if "duplicate or skipped" in str(exc):  # its next clock must follow the refused one
                    break
        store = ps.stores[0]
        assert store.pending_clocks == kept  # 4 MB each: at most (staleness + 1) * 4 MB held
        assert refused[0].endswith(
            f"rank 0 pushed clock {clocks[kept]}, {clocks[kept]} clocks past clock 0, the next this shard "
            f"applies; a push may run at most {staleness} clocks ahead (the staleness; 0 in sync mode), "
            "so it was not kept"
        )
        others = [client(ps, rank) for rank in (1, 2)]
        try:  # the honest workers still make clock 0, with the attacker's kept push in it
            for worker in others:
                worker.push(0, 1, [torch.ones(1_000_000)])
            version, weights = others[0].pull(1)[0]
            assert version == 1 and weights[:2].tolist() == [-0.5, -0.5]
        finally:
            for worker in others:
                worker.close()
    finally:
        attacker.close()
        ps.stop()


# --- finite weights -------------------------------------------------------------------------


def test_an_async_push_that_would_make_a_weight_infinite_is_undone_and_refused():
    """Before, pushes checked finite could still drive a weight to infinity (three pushes of
    3e38, lr 0.5: 1 - 4.5e38 overflows) and the server served it; now the update is undone,
    the push refused and counted, and the weights served stay the last finite ones."""
    ps = serve([1.0, 2.0], PsMode.ASYNC, workers=1)
    worker = client(ps, 0)
    try:
        for version in range(2):
            worker.push(version, 1, [torch.full((2,), 3e38)])
        with pytest.raises(PushRejected) as refused:
            worker.push(2, 1, [torch.full((2,), 3e38)])
        assert str(refused.value).endswith(
            "the update of rank 0's push based on version 2 left a weight NaN or infinite and was undone: "
            "the shard keeps its weights from before it (a push of huge values, or a learning rate too "
            "high: lower optimizer.lr, or clip the gradients)"
        )
        version, weights = worker.pull(3)[0]
        assert version == 2 and weights.tolist() == pytest.approx([-3e38, -3e38], rel=1e-6)
        assert all(math.isfinite(w) for w in weights.tolist())
        assert ps.nonfinite_pushes == 1 and ps.rejected_pushes == 1
        worker.push(2, 1, [torch.full((2,), -1e38)])  # a sane push after it applies as before
        assert worker.pull(3)[0][1].tolist() == pytest.approx([-2.5e38, -2.5e38], rel=1e-6)
    finally:
        worker.close()
        ps.stop()


def test_a_sync_clock_whose_update_would_make_a_weight_infinite_passes_without_moving_them():
    """Sync: the clock whose mean step overflows (each clock moves the weights by -0.75e38; the
    fifth would leave -3.75e38, past float32's 3.4e38) is undone; the pusher that completed it
    is told, and the clock passes as one that moved nothing, so the other's pull goes on."""
    ps = serve([1.0, 2.0], PsMode.SYNC, workers=2)
    workers = [client(ps, rank) for rank in range(2)]
    try:
        for clock in range(4):
            for worker in workers:
                worker.push(clock, 1, [torch.full((2,), 1.5e38)])
        workers[0].push(4, 1, [torch.full((2,), 1.5e38)])
        with pytest.raises(PushRejected, match="the update of clock 4, which rank 1's push completed, left"):
            workers[1].push(4, 1, [torch.full((2,), 1.5e38)])
        version, weights = workers[0].pull(5)[0]
        assert version == 5 and weights.tolist() == pytest.approx([-3e38, -3e38], rel=1e-6)
        assert ps.nonfinite_pushes == 1
    finally:
        for worker in workers:
            worker.close()
        ps.stop()


# --- worker lines in the driver's log -------------------------------------------------------


def worker_lines(caplog, rank):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"[rank {rank}] ")]


def test_a_rank_s_bucket_refills_at_its_rate_and_its_dropped_count_is_said_once_a_half_minute(caplog):
    now = [0.0]
    lines = WorkerLines(
        2, logging.getLogger("test.lines"), "log records", burst=3, per_s=2.0, clock=lambda: now[0]
    )
    with caplog.at_level(logging.WARNING, logger="test.lines"):
        assert [lines.admit(0) for _ in range(5)] == [True, True, True, False, False]
        assert lines.admit(1)  # every rank has its own bucket
        now[0] = 1.0  # two lines' worth refilled
        assert [lines.admit(0) for _ in range(3)] == [True, True, False]  # the first says the 2 dropped
        now[0] = 2.0
        assert lines.admit(0)  # the 1 dropped since is not said yet: within SAY_EVERY_S
        assert [lines.admit(rank) for rank in (7, -1, 9, 9)] == [True, True, True, False]  # one bucket
        now[0] = 1.0 + SAY_EVERY_S
        lines.admit(0)
        lines.flush()
    assert [r.getMessage() for r in caplog.records] == [
        "[rank 0] 2 log records dropped: a rank may log 3 at once, then 2 a second",
        "[rank 0] 1 log records dropped: a rank may log 3 at once, then 2 a second",
        "[ranks outside the fit's 2] 1 log records dropped: a rank may log 3 at once, then 2 a second",
    ]


def test_a_rank_s_log_records_are_a_burst_then_a_rate_and_the_rest_counted_once(caplog):
    """Before, every LOG frame was a line of the driver's log (a secret holder wrote 100 MB in
    2 s); now a rank logs BURST lines at once, then PER_S a second, and the lines dropped are
    said once, in one line. The clock is stopped: the bucket never refills."""
    server = ProgressServer(ProgressBoard(2, 1, show=False), "127.0.0.1", SECRET, 10.0, clock=lambda: 50.0)
    try:
        with caplog.at_level(logging.WARNING, logger="sparkdl.worker"):
            reporter = ProgressReporter(server.endpoint(), 1, 0)
            for line in range(BURST + 300):
                assert reporter.log(logging.WARNING, f"line {line}: " + "x" * 1000)
            reporter.close()  # its GOODBYE comes after every record: the rank leaves silence()
            assert wait_until(lambda: 1 not in server.silence())
            logged = worker_lines(caplog, 1)
            assert len(logged) == BURST and logged[-1].startswith(f"[rank 1] line {BURST - 1}: ")
            server.stop()
            assert worker_lines(caplog, 1)[BURST:] == [
                f"[rank 1] 300 log records dropped: a rank may log {BURST} at once, then {PER_S:g} a second"
            ]
    finally:
        server.stop()


def test_a_rank_s_stop_reasons_on_the_parameter_server_are_rate_limited(caplog):
    """The parameter server logs a line per ABORT: before, without bound; now as many as
    a rank's bucket holds (the aborts themselves all take effect)."""
    ps = serve([1.0, 2.0], PsMode.SYNC, workers=2)
    worker = client(ps, 0)
    try:
        with caplog.at_level(logging.WARNING, logger="sparkdl.services.ps"):
            started = time.monotonic()
            for n in range(BURST + 300):
                worker.abort(f"stop {n}")
            elapsed = time.monotonic() - started
            stopped = [r for r in caplog.records if "parameter server: rank 0 stopped" in r.getMessage()]
            assert BURST <= len(stopped) <= BURST + PER_S * elapsed + 1
            worker.close()
            ps.stop()
            dropped = [r.getMessage() for r in caplog.records if "stop reasons dropped" in r.getMessage()]
            assert sum(int(m.split()[2]) for m in dropped) == BURST + 300 - len(stopped)
    finally:
        ps.stop()
