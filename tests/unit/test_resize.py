"""Going on with fewer workers (``reliability.min_workers``): the decision after a failed
stage, the watch that cancels a stage waiting for lost slots, the history's record, and
the settings that cannot shrink. The whole path on a real standalone cluster is in
tests/spark/test_cluster_faults.py."""

from __future__ import annotations

import pytest

from sparkdl.config import SparkDLConfig
from sparkdl.errors import ConfigError, WorkersLostError
from sparkdl.spark.resize import Resize, next_size, note_resizes, workers_after_loss
from sparkdl.spark.watch import SlotWatch
from sparkdl.strategies import check_settings
from sparkdl.worker.prepare import check_own_loop_settings


class FakeTime:
    """A clock that ``sleep`` moves on, and slot counts read in turn (the last repeats)."""

    def __init__(self, slots: list[int]) -> None:
        self.now, self.slots, self.probes = 0.0, list(slots), 0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def probe(self) -> int:
        self.probes += 1
        return self.slots.pop(0) if len(self.slots) > 1 else self.slots[0]


def decide(slots: list[int], required: int = 4, floor: int = 2, wait_s: float = 10.0) -> int | None:
    time = FakeTime(slots)
    return workers_after_loss(time.probe, required, floor, wait_s, time.clock, time.sleep)


def test_a_failure_with_every_slot_there_is_no_loss_of_workers():
    assert decide([4]) is None  # the failure stands (bad data, a bug): nothing to resize


def test_slots_that_come_back_within_the_wait_restart_the_stage_at_full_size():
    assert decide([3, 3, 3, 4]) == 4


def test_slots_short_after_the_wait_leave_the_workers_that_remain():
    time = FakeTime([3])
    assert workers_after_loss(time.probe, 4, 2, 10.0, time.clock, time.sleep) == 3
    assert time.now == pytest.approx(10.0)  # it waited the whole bound for the slots to return


def test_fewer_slots_than_min_workers_fail_naming_both_counts_and_the_settings():
    with pytest.raises(WorkersLostError) as raised:
        decide([1], floor=2)
    error = raised.value
    assert (error.available, error.required, error.setting) == (1, 4, "runtime.executor_wait_timeout_s")
    assert "1 task slot(s) left for 4 workers" in str(error) and "min_workers = 2" in str(error)
    with pytest.raises(WorkersLostError):
        decide([0], floor=0)  # no slot at all: never zero workers


def after(error: BaseException, slots: list[int], required: int = 4, floor: int = 2) -> int | None:
    time = FakeTime(slots)
    return next_size(error, time.probe, required, floor, 10.0, time.clock, time.sleep)


def test_only_a_real_loss_restarts_the_stage():
    lost = WorkersLostError("the watch cancelled the stage", available=3, required=4)
    failed = RuntimeError("a worker's own error")
    assert after(lost, [4]) == 4  # the watch cancelled, the slots are back by now: full size
    assert after(lost, [3]) == 3  # still short: on the slots left, at once (the watch waited)
    assert after(failed, [4]) is None  # nothing lost: the error stands
    assert after(failed, [3, 3, 4]) is None  # an executor relaunched: the error stands, no rerun
    assert after(failed, [3]) == 3  # a host gone for good, found after the stall: go on with 3
    with pytest.raises(WorkersLostError):
        after(failed, [1])

    def broken() -> int:
        raise RuntimeError("py4j: the JVM is gone")

    assert next_size(failed, broken, 4, 2, 10.0) is None  # the original error stands


def test_the_watch_cancels_only_after_the_slots_were_short_for_the_whole_wait():
    slots = [2]
    watch = SlotWatch(lambda: slots[0], required=2, wait_s=5.0)
    assert watch.lost(0.0) is None
    slots[0] = 1
    assert watch.lost(1.0) is None and watch.lost(5.9) is None  # short since 1.0
    slots[0] = 2
    assert watch.lost(6.5) is None  # back: a relaunched executor, not a lost one
    slots[0] = 1
    assert watch.lost(7.0) is None and watch.lost(11.9) is None
    lost = watch.lost(12.0)
    assert isinstance(lost, WorkersLostError) and (lost.available, lost.required) == (1, 2)
    assert "for 5s" in str(lost) and "Set reliability.min_workers to go on" in str(lost)
    going_on = SlotWatch(lambda: 1, required=2, wait_s=0.0, resizes=True).lost(0.0)
    assert going_on is not None and "It goes on with fewer workers" in str(going_on)
    none_left = SlotWatch(lambda: 0, required=2, wait_s=0.0).lost(0.0)
    assert none_left is not None and "No executor is left" in str(none_left)


def test_the_history_marks_the_epoch_the_last_resize_resumed_in():
    history = [
        {"epoch": 1, "resumed_from_step": 4},  # an older resume, restored from the checkpoint
        {"epoch": 2},
        {"epoch": 3, "resumed_from_step": 20},
        {"epoch": 4},
    ]
    note_resizes(history, [Resize(4, 3, 100.0, "x"), Resize(3, 2, 200.0, "y")])
    assert history[2] == {
        "epoch": 3, "resumed_from_step": 20, "workers": 2, "lost_workers": 1, "resized_at": 200.0,
    }  # fmt: skip
    assert all("workers" not in h for i, h in enumerate(history) if i != 2)
    fresh = [{"epoch": 1}, {"epoch": 2}]  # no checkpoint: the fit started again
    note_resizes(fresh, [Resize(2, 1, 5.0, "z")])
    assert fresh[0]["lost_workers"] == 1 and "workers" not in fresh[1]


def test_settings_that_cannot_shrink_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="min_workers = 3 is more than num_workers = 2"):
        check_settings(SparkDLConfig().replace(num_workers=2, min_workers=3))
    for strategy in ("parameter_server", "pipeline"):
        with pytest.raises(ConfigError, match=f"strategy '{strategy}'.*set min_workers = 0"):
            check_settings(SparkDLConfig().replace(num_workers=4, min_workers=2, strategy=strategy))
    for strategy in ("allreduce", "fsdp", "weight_averaging"):
        check_settings(SparkDLConfig().replace(num_workers=4, min_workers=2, strategy=strategy))
    check_settings(SparkDLConfig().replace(num_workers=2, min_workers=2, strategy="parameter_server"))
    with pytest.raises(ConfigError, match="min_workers = 1 cannot serve your own training loop"):
        check_own_loop_settings(SparkDLConfig().replace(num_workers=2, min_workers=1))
