"""The progress board's arithmetic, and the real channel on loopback sockets."""

from __future__ import annotations

import dataclasses
import logging
import math
import socket
import threading
import time

import pytest

from sparkdl.errors import ConnectionClosed
from sparkdl.services.progress.board import ProgressBoard, Report
from sparkdl.services.progress.channel import ForwardToDriver, ProgressReporter, ProgressServer
from sparkdl.services.progress.protocol import (
    MAX_PAYLOAD,
    PROGRESS_WIRE,
    REPORT_PAYLOAD,
    Ack,
    Heartbeat,
    Log,
    client_hello,
)
from sparkdl.wire.framing import Channel

SECRET = b"p" * 32


class FakeBar:
    """Records what a bar was told to show."""

    def __init__(self, title):
        self.title, self.total, self.n, self.figures, self.closed = title, None, 0, "", False

    def show(self, steps, total, figures):
        self.n, self.total, self.figures = steps, total, figures

    @property
    def postfix(self) -> dict[str, str]:
        """The figures after the time, by name."""
        return dict(part.split("=") for part in self.figures.split(", ")[1:])

    @property
    def time(self) -> str:
        return self.figures.split(", ")[0]

    def close(self):
        self.closed = True


def board(**kwargs):
    bars = []

    def factory(title):
        bars.append(FakeBar(title))
        return bars[-1]

    return ProgressBoard(2, 3, bar_factory=factory, **kwargs), bars


def test_without_a_terminal_each_epoch_is_one_line_written_when_it_ends(capsys):
    b = ProgressBoard(2, 2)  # capsys: stderr is no terminal, and no notebook kernel runs
    for steps in (1, 2, 3):
        for rank in (0, 1):
            b.update(Report(rank, 1, 0, steps, total_steps=-1, samples=10 * steps, loss_sum=5.0, seconds=1.0))
    assert capsys.readouterr().err == ""  # nothing while the epoch runs
    b.update(Report(0, 2, 0, steps=1, total_steps=3, samples=10, loss_sum=1.0, seconds=1.0))
    (line,) = capsys.readouterr().err.splitlines()  # epoch 1 ended when epoch 2 began
    assert line.startswith("epoch 1/2: 3 steps, ") and line.endswith(", loss=0.1667, samples_s=60"), line
    b.update(Report(0, 2, 0, steps=3, total_steps=3, samples=30, loss_sum=3.0, seconds=1.0))
    b.update(Report(1, 2, 0, steps=3, total_steps=3, samples=30, loss_sum=3.0, seconds=1.0))
    b.close()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("epoch 2/2: 3/3 steps, ") and line.endswith(", loss=0.1000, samples_s=60"), line


def test_an_epochs_line_carries_the_seconds_the_workers_measured_not_the_drivers(capsys):
    """Reports reach the driver in jumps, the first one late: the line's seconds are the
    slowest worker's own count since the epoch began (before: the driver's, from its first
    report, 0.0s here)."""
    b = ProgressBoard(2, 1)
    b.update(Report(0, 1, 0, steps=8, total_steps=8, samples=64, loss_sum=32.0, seconds=2.25))
    b.update(Report(1, 1, 0, steps=8, total_steps=8, samples=64, loss_sum=32.0, seconds=2.5))
    b.close()
    assert capsys.readouterr().err == "epoch 1/1: 8/8 steps, 2.5s, loss=0.5000, samples_s=54\n"


def test_the_loss_is_over_the_rows_of_the_workers_that_reported_one():
    """A rank whose loop reports no loss (or that sat the epoch out) sends NaN: the others'
    loss still shows (before: the NaN hid it)."""
    b, bars = board()
    b.update(Report(0, 1, 0, steps=4, total_steps=4, samples=40, loss_sum=20.0, seconds=2.0))
    b.update(Report(1, 1, 0, steps=4, total_steps=4, samples=30, loss_sum=math.nan, seconds=2.0))
    assert bars[0].postfix["loss"] == "0.5000"


def test_the_bar_shows_the_time_left_at_the_epochs_pace_and_no_loss_where_none_was_reported():
    b, bars = board()
    b.update(Report(0, 2, 0, steps=2, total_steps=8, samples=16, loss_sum=math.nan, seconds=1.0))
    assert bars[0].figures == "1.0s<3.0s, samples_s=16"  # 6 steps left at 0.5 s each
    b.update(Report(0, 2, 0, steps=8, total_steps=8, samples=64, loss_sum=math.nan, seconds=125.0))
    assert bars[0].figures == "02:05, samples_s=1"  # the end: nothing left; minutes as tqdm writes them


def test_the_board_says_what_happens_before_and_after_the_epochs(capsys):
    now = [100.0]
    b = ProgressBoard(2, 2, bar_factory=FakeBar, clock=lambda: now[0])
    b.stage_submitted("starting 2 workers")
    now[0] = 112.5
    b.worker_started(1, attempt=0)
    b.worker_started(1, attempt=0)  # a second connection of the same rank: counted once
    assert capsys.readouterr().err == "sparkdl: starting 2 workers\n"  # not every worker yet
    b.worker_started(0, attempt=0)
    assert capsys.readouterr().err == (
        "sparkdl: all 2 workers started, 12.5s after the stage was submitted; "
        "building the model and checking the first batch\n"
    )
    for epoch, seconds in ((1, 3.0), (2, 2.0)):
        for rank in (0, 1):
            b.update(
                Report(rank, epoch, 0, steps=5, total_steps=5, samples=40, loss_sum=8.0, seconds=seconds)
            )
    b.update(
        Report(0, 2, 0, steps=4, total_steps=5, samples=32, loss_sum=6.4, seconds=1.6)
    )  # a late frame ...
    b.finish()  # the stage's result is back
    b.update(
        Report(0, 2, 0, steps=5, total_steps=5, samples=40, loss_sum=8.0, seconds=2.0)
    )  # ... its last one
    assert capsys.readouterr().err == ""  # the summary waits for the channel to close
    now[0] = 120.0
    b.close()  # after the channel read what the workers sent last
    b.update(Report(1, 2, 0, steps=5, total_steps=5, samples=40, loss_sum=8.0, seconds=2.0))  # nothing drawn
    assert capsys.readouterr().err == (
        "sparkdl: 2 epochs trained in 5.0s, 10 steps, 160 samples, last epoch's loss 0.2000, "
        "20.0s after the stage was submitted\n"
    )
    quiet = ProgressBoard(2, 2, show=False)
    quiet.stage_submitted("starting 2 workers")
    quiet.worker_started(0, 0), quiet.worker_started(1, 0), quiet.finish(), quiet.close()
    assert capsys.readouterr().err == ""


def test_a_re_run_stage_says_its_workers_started_again(capsys):
    b = ProgressBoard(1, 1, bar_factory=FakeBar)
    b.worker_started(0, attempt=3)  # attempts count the stages of the fit's job group
    b.worker_started(0, attempt=4)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("sparkdl: the worker started; ")
    assert lines[1].startswith("sparkdl: the worker started again (Spark re-ran the stage); ")


def test_the_bar_shows_the_loss_over_every_row_and_the_samples_per_second_of_the_job():
    b, bars = board()
    b.update(Report(0, 1, 0, steps=4, total_steps=-1, samples=40, loss_sum=20.0, seconds=2.0))
    b.update(Report(1, 1, 0, steps=3, total_steps=-1, samples=30, loss_sum=3.0, seconds=1.5))
    assert bars[0].title == "epoch 1/3" and bars[0].total is None  # epoch 1: length unknown
    assert bars[0].n == 3  # the slowest worker's steps
    # the loss over all 70 rows; samples/s: each worker's own rate (20/s and 20/s), summed
    assert bars[0].postfix == {"loss": f"{23 / 70:.4f}", "samples_s": "40"}
    b.update(Report(0, 2, 0, steps=1, total_steps=10, samples=8, loss_sum=1.0, seconds=0.1))
    assert bars[0].closed and bars[1].title == "epoch 2/3" and bars[1].total == 10


def test_the_bar_shows_the_validation_loss_once_the_epoch_reports_it():
    b, bars = board()
    b.update(Report(0, 1, 0, steps=4, total_steps=4, samples=40, loss_sum=20.0, seconds=2.0))
    assert "val_loss" not in bars[0].postfix  # not measured yet
    b.update(Report(1, 1, 0, steps=4, total_steps=4, samples=40, loss_sum=20.0, seconds=2.0, val_loss=0.25))
    assert bars[0].postfix["val_loss"] == "0.2500"
    assert b.epoch_figures(1)["val_loss"] == 0.25


def test_a_report_with_its_validation_loss_crosses_the_wire_intact():
    report = Report(1, 3, 2, steps=5, total_steps=9, samples=80, loss_sum=4.5, seconds=1.25, val_loss=0.125)
    kind, fields, payload = PROGRESS_WIRE.encode(report)
    assert len(payload) == REPORT_PAYLOAD.size == 56
    assert PROGRESS_WIRE.decode(kind, fields, bytearray(payload)) == report


def test_reports_of_a_failed_attempt_do_not_overwrite_the_re_run():
    b, _ = board()
    b.update(Report(0, 1, 7, steps=2, total_steps=-1, samples=16, loss_sum=8.0, seconds=1.0))
    b.update(Report(0, 1, 3, steps=9, total_steps=-1, samples=72, loss_sum=9.0, seconds=4.0))  # late
    assert b.epoch_figures(1)["samples"] == 16


def test_a_quiet_board_draws_nothing_but_keeps_the_figures():
    b, bars = board(show=False)
    b.update(Report(1, 1, 0, steps=1, total_steps=-1, samples=8, loss_sum=4.0, seconds=1.0))
    assert bars == [] and b.epoch_figures(1)["loss"] == 0.5


def test_reports_and_worker_warnings_reach_the_driver_over_the_socket(caplog):
    b, _ = board(show=False)
    server = ProgressServer(b, "127.0.0.1", SECRET, interval_s=0.05)
    reporter = ProgressReporter(server.endpoint(), rank=1, attempt=0)
    handler = ForwardToDriver(reporter)
    worker_logger = logging.getLogger("sparkdl.some.worker.module")
    worker_logger.addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING, logger="sparkdl.worker"):
            assert reporter.due()
            reporter.send(Report(1, 1, 0, steps=5, total_steps=-1, samples=40, loss_sum=10.0, seconds=1.0))
            assert not reporter.due()  # rate-limited
            worker_logger.warning("the cache disk is %d%% full", 93)
            worker_logger.info("not forwarded")
            deadline = time.monotonic() + 10
            forwarded = "[rank 1] sparkdl.some.worker.module: the cache disk is 93% full"
            # (caplog also holds the worker-side record itself: wait for the forwarded one)
            while time.monotonic() < deadline and (
                b.epoch_figures(1)["samples"] < 40 or forwarded not in caplog.text
            ):
                time.sleep(0.02)
        assert b.epoch_figures(1)["loss"] == 0.25
        assert forwarded in caplog.text
        assert "not forwarded" not in caplog.text
    finally:
        worker_logger.removeHandler(handler)
        reporter.close()
        server.stop()
    assert not any(t.name.startswith("sparkdl-progress") and t.is_alive() for t in threading.enumerate())


def test_a_reporter_without_a_driver_trains_on_silently():
    b, _ = board(show=False)
    server = ProgressServer(b, "127.0.0.1", SECRET, interval_s=0.05)
    endpoint = server.endpoint()
    server.stop()  # the driver's port is closed
    reporter = ProgressReporter(endpoint, rank=0, attempt=0)
    assert not reporter.due()
    reporter.send(Report(0, 1, 0, 1, -1, 8, 1.0, 0.1))  # no exception
    reporter.log(logging.ERROR, "lost")


def test_a_reporter_with_the_wrong_secret_is_refused(caplog):
    b, _ = board(show=False)
    server = ProgressServer(b, "127.0.0.1", SECRET, interval_s=0.05)
    try:
        endpoint = server.endpoint()
        forged = dataclasses.replace(endpoint, secret=b"x" * 32)
        with caplog.at_level(logging.WARNING):
            reporter = ProgressReporter(forged, rank=0, attempt=0)
            assert not reporter.due()  # never connected
        assert b.epoch_figures(1)["samples"] == 0
    finally:
        server.stop()


@pytest.mark.parametrize("interval", [0.0, -1.0])
def test_the_report_interval_must_be_positive(interval):
    from sparkdl import ConfigError
    from sparkdl.config import SparkDLConfig

    with pytest.raises(ConfigError, match="progress_interval_s"):
        SparkDLConfig().replace(progress_interval_s=interval)


# --- the progress protocol ------------------------------------------------------------


def channel_pair(a, b, protocol):
    return (
        Channel(a, SECRET, protocol, b"n" * 16, client=True),
        Channel(b, SECRET, protocol, b"n" * 16, client=False),
    )


def test_a_report_and_a_log_record_cross_the_wire_with_every_field():
    report = Report(3, epoch=7, attempt=2, steps=11, total_steps=-1, samples=88, loss_sum=4.25, seconds=1.5)
    a, b = socket.socketpair()
    with a, b:
        worker, driver = channel_pair(a, b, PROGRESS_WIRE)
        sent = worker.send(report)
        assert sent == PROGRESS_WIRE.header.size + REPORT_PAYLOAD.size + 32  # header, 56 bytes, two tags
        assert driver.recv(MAX_PAYLOAD) == report
        worker.send(Log(3, 2, logging.ERROR, "disk full: 93%"))
        assert driver.recv(MAX_PAYLOAD) == Log(3, 2, logging.ERROR, "disk full: 93%")
        worker.send(Heartbeat(3, 2))
        assert driver.recv(MAX_PAYLOAD) == Heartbeat(3, 2)


def test_a_frame_naming_another_rank_than_its_hello_is_refused(caplog):
    b, _ = board(show=False)
    server = ProgressServer(b, "127.0.0.1", SECRET, interval_s=0.05)
    try:
        with (
            caplog.at_level(logging.WARNING, logger="sparkdl.services.progress"),
            socket.create_connection((server.host, server.port), timeout=5) as sock,
        ):
            channel = client_hello(sock, SECRET, rank=1, attempt=0, server_key=server.public_key)
            assert channel.recv(MAX_PAYLOAD) == Ack(1, 0)
            channel.send(Report(2, 1, 0, steps=1, total_steps=-1, samples=8, loss_sum=1.0, seconds=0.1))
            with pytest.raises(ConnectionClosed):  # the driver closed the connection
                channel.recv(MAX_PAYLOAD)
        assert "a frame of rank 2 attempt 0 on the connection of rank 1 attempt 0" in caplog.text
        assert b.epoch_figures(1)["samples"] == 0
    finally:
        server.stop()


def test_a_stage_whose_workers_have_not_started_says_what_it_waits_for_once(capsys):
    b = ProgressBoard(2, 1, bar_factory=FakeBar)
    b.stage_submitted("starting 2 workers", note_wait_s=0.05)
    time.sleep(0.5)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "sparkdl: starting 2 workers"
    assert lines[1].startswith("sparkdl: no worker started yet, 0s after the stage was submitted: its 2 ")
    assert len(lines) == 2
    started = ProgressBoard(2, 1, bar_factory=FakeBar)
    started.stage_submitted("starting 2 workers", note_wait_s=0.05)
    started.worker_started(0, attempt=0)
    time.sleep(0.5)
    assert "no worker started yet" not in capsys.readouterr().err  # one had: nothing to explain
    b.close(), started.close()
