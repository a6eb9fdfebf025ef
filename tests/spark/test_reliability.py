"""Faults injected on purpose into real barrier stages: resume, redo, and fail clearly."""

from __future__ import annotations

import logging
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from sparkdl import TrainingFailedError
from sparkdl.errors import CheckpointError
from sparkdl.storage.checkpoint_store import CheckpointStore
from tests.reference import make_shards, max_abs_diff
from tests.spark.test_fit import estimator, fit_in_one_attempt, shards_dataframe

pytestmark = [pytest.mark.spark, pytest.mark.slow]

EVERY = 4  # checkpoint_every, in steps


def run(spark, tmp_path, name, drill="", epochs=2, **settings):
    shards = make_shards([96, 96])
    settings = {"collective_timeout_s": 20.0, **settings}
    est = estimator(
        epochs=epochs,
        shuffle=True,
        checkpoint_dir=str(tmp_path / name),
        checkpoint_every=EVERY,
        fault_injection=drill,
        **settings,
    )
    started = time.monotonic()
    model = est.fit(shards_dataframe(spark, shards))
    return model, time.monotonic() - started


@pytest.fixture(scope="module")
def clean_run(spark, tmp_path_factory):
    model, _ = run(spark, tmp_path_factory.mktemp("clean"), "ckpt")
    return model


@pytest.mark.parametrize(("kind", "rank", "step"), [("raise", 1, 10), ("exit", 0, 17)])
def test_a_failed_worker_resumes_from_the_last_checkpoint_with_identical_weights(
    spark, tmp_path, clean_run, kind, rank, step
):
    marker = tmp_path / "fired"
    model, _ = run(spark, tmp_path, "ckpt", f"{kind}:{rank}:{step}:{marker}")
    assert marker.exists()  # the drill did fire
    assert max_abs_diff(model.module.state_dict(), clean_run.module.state_dict()) == 0.0
    _check_resume_record(model, step)


def test_weight_averaging_resumes_after_an_average_with_identical_weights(spark, tmp_path):
    settings = {"strategy": "weight_averaging", "sync_every": 2}
    clean, _ = run(spark, tmp_path, "clean", **settings)
    model, _ = run(spark, tmp_path, "ckpt", f"raise:1:13:{tmp_path / 'fired'}", **settings)
    assert max_abs_diff(model.module.state_dict(), clean.module.state_dict()) == 0.0
    _check_resume_record(model, 13)


def _check_resume_record(model, step):
    resumed = [h for h in model.history if "resumed_from_step" in h]
    assert len(resumed) == 1
    record = resumed[0]
    assert record["resumed_from_step"] == step - step % EVERY
    assert 0 <= record["steps_redone"] <= EVERY
    assert record["steps_redone"] == step - record["resumed_from_step"]
    assert record["recovery_s"] > 0
    assert [h["epoch"] for h in model.history] == [1, 2]
    print(f"FIGURE resume step={step} redone={record['steps_redone']} recovery_s={record['recovery_s']:.2f}")


def test_a_fault_on_every_attempt_fails_with_the_original_error_and_rank(spark, tmp_path):
    with pytest.raises(TrainingFailedError, match=r"rank 1 .*fault drill: rank 1 raised at step 3"):
        run(spark, tmp_path, "ckpt", "raise:1:3:")  # no marker: fires on every attempt


def test_a_worker_that_stops_responding_is_detected_within_the_timeout(spark, tmp_path, clean_run):
    timeout = 8.0
    model, _ = run(spark, tmp_path, "ckpt", f"hang:1:6:{tmp_path / 'fired'}", collective_timeout_s=timeout)
    assert max_abs_diff(model.module.state_dict(), clean_run.module.state_dict()) == 0.0
    # the stuck rank is given up on after the collective timeout, not Spark's default of
    # minutes: from the last step before the hang to the resumed run's first, within one fit
    # (a clean fit's time subtracted from this one's varied by more than the bound on 2 busy cores)
    (resumed,) = [h for h in model.history if "resumed_from_step" in h]
    assert timeout <= resumed["recovery_s"] < timeout + 20, resumed
    print(f"FIGURE hang timeout={timeout} recovery_s={resumed['recovery_s']:.2f}")


def test_a_tampered_checkpoint_is_refused(spark, tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))

    class Payload:
        def __reduce__(self):
            return (print, ("pickled code ran",))

    torch.save({"format": 1, "evil": Payload()}, store.path_for(8))
    with pytest.raises(CheckpointError, match=r"refused checkpoint .*checkpoint-000000008\.pt"):
        run(spark, tmp_path, "ckpt")


def poisoned_loss(output, target):
    """Cross entropy, but NaN for any batch holding a row labelled 7 (a planted bad row)."""
    loss = torch.nn.functional.cross_entropy(output, target.clamp(max=2).long())
    return loss * torch.where((target == 7).any(), torch.tensor(float("nan")), torch.tensor(1.0))


def poisoned_dataframe(spark):
    x, y = make_shards([48, 48])[0], make_shards([48, 48])[1]
    y[1][5] = 7  # one row on rank 1
    return shards_dataframe(spark, [x, y])


@pytest.mark.parametrize("strategy", ["allreduce", "weight_averaging", "parameter_server"])
def test_nan_steps_are_skipped_everywhere_and_counted(spark, strategy):
    est = estimator(loss_fn=poisoned_loss, on_nan_loss="skip", epochs=3, strategy=strategy, ps_timeout_s=15.0)
    model = est.fit(poisoned_dataframe(spark))
    # the poisoned row is on rank 1: with all-reduce every rank skips that step (they share
    # the averaged gradient); with local steps only rank 1's step is skipped
    per_worker = [1, 1] if strategy == "allreduce" else [0, 1]
    assert [h["worker_nan_skips"] for h in model.history] == [per_worker] * 3
    assert [h["nan_skips"] for h in model.history] == [1, 1, 1]
    assert all(torch.isfinite(v).all() for v in model.module.state_dict().values())


@pytest.mark.parametrize("strategy", ["allreduce", "weight_averaging", "parameter_server"])
def test_a_nan_loss_on_one_rank_stops_every_rank_with_the_step_and_rank(spark, strategy, caplog):
    est = estimator(loss_fn=poisoned_loss, on_nan_loss="error", strategy=strategy, ps_timeout_s=15.0)
    with (
        caplog.at_level(logging.ERROR, logger="sparkdl.worker"),
        pytest.raises(TrainingFailedError, match=r"non-finite loss or gradient at rank 1, epoch 1, step 0"),
    ):
        fit_in_one_attempt(spark, est, poisoned_dataframe(spark))
    # the worker's error also reached the driver's log, with its rank, while the stage ran
    assert any(
        r.getMessage().startswith("[rank 1] TrainingFailedError: non-finite loss") for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


def test_a_parameter_server_keeps_its_weights_across_a_stage_re_run(spark, tmp_path):
    """The retried stage reconnects as a new attempt; the server's clocks restart, its weights do not."""
    shards = make_shards([96, 96])
    settings = dict(strategy="parameter_server", ps_mode="sync", ps_timeout_s=15.0, epochs=2, shuffle=True)
    clean = estimator(**settings).fit(shards_dataframe(spark, shards))
    drilled = estimator(fault_injection=f"raise:1:10:{tmp_path / 'fired'}", **settings).fit(
        shards_dataframe(spark, shards)
    )
    assert (tmp_path / "fired").exists()
    # the re-run trained all 24 steps again on top of the 10 already applied by the server
    assert sum(h["pushes"] for h in drilled.history) == sum(h["pushes"] for h in clean.history)
    assert max_abs_diff(drilled.module.state_dict(), clean.module.state_dict()) > 0
    assert drilled.history[-1]["loss"] <= clean.history[-1]["loss"] * 1.5


PS_SYNC = {"strategy": "parameter_server", "ps_mode": "sync", "ps_timeout_s": 15.0}


def test_a_parameter_server_run_resumes_from_its_snapshots_with_identical_weights(spark, tmp_path):
    """The server returns to its snapshot of the checkpoint's step; the workers continue from there."""
    clean, _ = run(spark, tmp_path, "clean", **PS_SYNC)
    model, _ = run(spark, tmp_path, "ckpt", f"raise:1:10:{tmp_path / 'fired'}", **PS_SYNC)
    assert (tmp_path / "fired").exists()
    assert max_abs_diff(model.module.state_dict(), clean.module.state_dict()) == 0.0
    # the resumed attempt pushed only the steps after the checkpoint of step 8
    assert sum(h["pushes"] for h in model.history) == sum(h["pushes"] for h in clean.history) - 8
    _check_resume_record(model, 10)
    shard_files = sorted(p.name for p in (tmp_path / "ckpt").glob("ps-shard-*.pt"))
    assert shard_files and all(p.endswith(("000000020.pt", "000000024.pt")) for p in shard_files)


@pytest.mark.parametrize("strategy", ["allreduce", "parameter_server"])
def test_a_new_fit_on_the_same_checkpoint_dir_resumes_after_the_application_failed(
    spark, tmp_path, clean_run, strategy
):
    settings = PS_SYNC if strategy == "parameter_server" else {}
    clean = clean_run if strategy == "allreduce" else run(spark, tmp_path, "clean", **settings)[0]
    with pytest.raises(TrainingFailedError, match="rank 1 raised at step 10"):
        run(spark, tmp_path, "ckpt", "raise:1:10:", **settings)  # fails on every attempt: fit gives up
    model, _ = run(spark, tmp_path, "ckpt", **settings)  # a new fit: new driver state, new server
    assert max_abs_diff(model.module.state_dict(), clean.module.state_dict()) == 0.0
    _check_resume_record(model, 10)


def _python_listening_ports(jvm: int) -> set[int]:
    """Listening TCP ports of Python processes forked from a PySpark daemon (task workers)
    of the Spark JVM ``jvm`` (this session's: a test in the other pytest process has its own).

    The daemons themselves (children of the JVM) keep their own listening socket for
    the life of the session; a task's worker must not keep one after its task ends.
    """
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    ports = set()
    for line in out.splitlines():
        match = re.search(r'"python[^"]*",pid=(\d+)', line)
        if match and _parent_is_python(int(match.group(1))) and _descends_from(int(match.group(1)), jvm):
            ports.add(int(line.split()[3].rsplit(":", 1)[1]))
    return ports


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _parent_is_python(pid: int) -> bool:
    try:
        return "python" in Path(f"/proc/{_parent(pid)}/comm").read_text()
    except OSError:
        return False


def _descends_from(pid: int, ancestor: int) -> bool:
    try:
        for _ in range(64):  # bounded: a process tree is never that deep here
            if pid <= 1:
                return False
            pid = _parent(pid)
            if pid == ancestor:
                return True
    except OSError:
        return False
    return False


def test_cancelling_the_job_ends_the_tasks_and_closes_their_ports(spark, tmp_path):
    spark.range(4).mapInArrow(lambda batches: batches, "id long").collect()  # Python workers up
    jvm = spark.sparkContext._gateway.proc.pid  # this session's JVM: the daemons are its children
    before = _python_listening_ports(jvm)
    progress = CheckpointStore(str(tmp_path / "ckpt"))
    timeout = 10.0
    est = estimator(
        epochs=500, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1000, collective_timeout_s=timeout
    )
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            est.fit(shards_dataframe(spark, make_shards([64, 64])))
        except BaseException as exc:  # the cancelled fit must fail, and say so
            errors.append(exc)

    thread = threading.Thread(target=fit, name="fit-to-cancel")
    thread.start()
    deadline = time.monotonic() + 60
    while (progress.progress() is None or progress.progress().step < 20) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert progress.progress() is not None, "training never started"
    assert _python_listening_ports(jvm) - before, "training opened no port: the check below would be vacuous"
    cancelled = time.monotonic()
    spark.sparkContext.cancelAllJobs()
    thread.join(60)
    assert not thread.is_alive() and errors, "fit did not end after the cancel"
    # Spark kills the Python workers of killed tasks within spark.python.task.killTimeout
    # after it notices; wait (bounded) until no worker advances the step any more.
    last, still_since = progress.progress().step, time.monotonic()
    while time.monotonic() - still_since < 3 and time.monotonic() - cancelled < 30:
        time.sleep(0.5)
        step = progress.progress().step
        if step != last:
            last, still_since = step, time.monotonic()
    ended_after = still_since - cancelled
    assert time.monotonic() - still_since >= 3, "a worker was still training 30 s after the cancel"
    # A rank left waiting on a killed peer gives up at the collective timeout at the latest.
    while _python_listening_ports(jvm) - before and time.monotonic() - cancelled < timeout + 15:
        time.sleep(0.5)
    ports_closed_after = time.monotonic() - cancelled
    assert not _python_listening_ports(jvm) - before, "a port opened by training is still open"
    print(f"FIGURE cancel tasks_ended_s={ended_after:.2f} ports_closed_s={ports_closed_after:.2f}")


def _stage_attempt_name(_):
    """A barrier task's view of its stage attempt, as a worker names it: the smallest task id."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    yield min(int(i) for i in context.allGather(str(context.taskAttemptId())))


def test_the_driver_believes_only_the_stage_attempts_spark_runs(spark):
    """The gate of the driver's servers (a HELLO claiming a newer stage attempt) reads the
    attempt's name from Spark's status store: the one the tasks compute, and no other."""
    from sparkdl.spark.attempts import attempt_gate, running_attempts

    sc = spark.sparkContext
    group = "sparkdl-test-attempt-gate"
    sc.setJobGroup(group, "the attempt gate")
    try:
        names = (
            sc.parallelize(range(2), 2).barrier().mapPartitions(_stage_attempt_name).repartition(1).collect()
        )
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    assert len(set(names)) == 1
    started = attempt_gate(sc, group, wait_s=0.5)
    assert started(names[0])
    assert not started(names[0] + 1) and not started(names[0] + 10_000)
    assert names[0] in running_attempts(sc, group)
    assert running_attempts(sc, "no-such-group") == set()
