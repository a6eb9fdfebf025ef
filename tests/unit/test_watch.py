"""The driver's bound on a stage whose workers stop reporting."""

from __future__ import annotations

import secrets
import socket
import threading
import time

from sparkdl.errors import StageStalledError, WaitTimeout
from sparkdl.services.progress.board import ProgressBoard
from sparkdl.services.progress.channel import ProgressReporter, ProgressServer
from sparkdl.services.progress.protocol import client_hello
from sparkdl.spark.watch import StallMonitor, find_stall


def test_a_stall_is_a_rank_silent_for_longer_than_the_bound():
    assert find_stall({0: 3.0, 1: 59.0}, 60.0) is None
    stall = find_stall({0: 3.0, 1: 61.0, 2: 75.0}, 60.0)
    assert stall is not None and stall.silent == {1: 61.0, 2: 75.0}
    error = stall.error()
    assert isinstance(error, StageStalledError) and isinstance(error, WaitTimeout)
    assert (error.setting, error.limit_s) == ("runtime.collective_timeout_s", 60.0)
    assert "rank 1 (61s), rank 2 (75s)" in error.message
    assert "runtime.collective_timeout_s + runtime.teardown_timeout_s" in error.message


def test_a_worker_that_stops_heartbeating_gets_the_stage_cancelled_and_named():
    secret = secrets.token_bytes(32)
    server = ProgressServer(ProgressBoard(2, 1, show=False), "127.0.0.1", secret, 0.5)
    alive = ProgressReporter(server.endpoint(), rank=0, attempt=5, heartbeat_s=0.2)
    # rank 1 says HELLO and then nothing at all: a process stuck with the GIL held
    stuck = socket.create_connection((server.host, server.port), timeout=5)
    client_hello(stuck, secret, 1, 5, server_key=server.public_key)
    cancelled = threading.Event()
    try:
        with StallMonitor(server.silence, bound_s=1.0, cancel=cancelled.set, poll_s=0.1) as monitor:
            assert cancelled.wait(10), "the monitor never cancelled the stage"
        assert monitor.stall is not None and list(monitor.stall.silent) == [1]  # rank 0 kept talking
    finally:
        alive.close()
        stuck.close()
        server.stop()


def test_a_worker_that_finished_and_closed_is_not_a_stall():
    secret = secrets.token_bytes(32)
    server = ProgressServer(ProgressBoard(1, 1, show=False), "127.0.0.1", secret, 0.5)
    try:
        reporter = ProgressReporter(server.endpoint(), rank=0, attempt=1)
        deadline = time.monotonic() + 5
        while 0 not in server.silence() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert 0 in server.silence()
        reporter.close()
        while 0 in server.silence() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.silence() == {}
    finally:
        server.stop()


def test_a_connection_that_ends_without_a_goodbye_leaves_its_rank_watched():
    """A bare EOF (a killed worker, a cut or forged close on the network) is no goodbye: the
    driver keeps counting the rank's silence, and the watchdog names it. Before, any EOF made
    the driver forget the rank, hiding it from the watchdog."""
    secret = secrets.token_bytes(32)
    now = [0.0]
    server = ProgressServer(ProgressBoard(2, 1, show=False), "127.0.0.1", secret, 0.5, clock=lambda: now[0])
    vanished = socket.create_connection((server.host, server.port), timeout=5)
    channel = client_hello(vanished, secret, 1, 2, server_key=server.public_key)
    try:
        assert channel.recv(1 << 16) is not None  # the ACK: rank 1 is in the session
        deadline = time.monotonic() + 5
        while 1 not in server.silence() and time.monotonic() < deadline:
            time.sleep(0.02)
        vanished.close()  # EOF, no goodbye
        time.sleep(0.3)
        now[0] = 9.0
        assert server.silence() == {1: 9.0}
        assert find_stall(server.silence(), 5.0) is not None
        # the same worker's goodbye ends its session: it leaves the watch
        finished = ProgressReporter(server.endpoint(), rank=0, attempt=2)
        while 0 not in server.silence() and time.monotonic() < deadline:
            time.sleep(0.02)
        finished.close()
        while 0 in server.silence() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert set(server.silence()) == {1}
    finally:
        server.stop()
