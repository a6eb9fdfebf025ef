"""The asynchronous (and stale-synchronous) parameter server in ordinary tasks
(``ps_barrier = false``) on real Spark: a task whose Python dies mid-epoch is retried alone
while the others push on, every row of every epoch is trained once (counted on the server),
and the accuracy is an undisturbed run's. The drill runs in its own process (``local[3, 4]``:
tasks may fail)."""

from __future__ import annotations

import pytest

from tests.spark.independent_ps_drill import EPOCHS, ROWS
from tests.spark.processes import run_drill

pytestmark = [pytest.mark.spark, pytest.mark.slow]

#: The longest a running worker may go between two pushes while another is retried (its
#: steps take about 0.03 s; the retry's Python restart takes seconds).
GAP_BOUND_S = 3.0


def test_a_killed_task_is_retried_alone_and_every_row_is_trained_once_per_epoch(tmp_path):
    result = run_drill("independent_ps_drill.py", tmp_path, timeout=300)
    calm, killed = result["undisturbed"], result["killed"]
    last = killed["history"][-1]
    # the retry: partition 1 alone, a newer task, skipping what its predecessor's pushes covered
    retries = last["task_retries"]
    assert [r["partition"] for r in retries] == [1]
    assert retries[0]["task_id"] > retries[0]["replaced_task_id"] >= 0
    assert 0 < retries[0]["rows_skipped"] < ROWS and retries[0]["rows_skipped"] % 8 == 0
    # every row of every epoch in the server's weights exactly once, in both runs
    for run in (calm, killed):
        assert run["history"][-1]["partition_rows_applied"] == [EPOCHS * ROWS] * 3
        assert run["rows"] == [ROWS] * 3
    # the others never paused: no gap between their pushes past the bound; partition 1's did
    gaps = last["partition_push_gap_max_s"]
    assert gaps[0] < GAP_BOUND_S and gaps[2] < GAP_BOUND_S, gaps
    assert gaps[1] > max(gaps[0], gaps[2]), gaps
    # the retried partition skipped its predecessor's steps, then trained the rest
    assert sum(killed["history"][0]["worker_skipped_steps"]) == retries[0]["rows_skipped"] // 8
    # a new fit on the killed one's checkpoint_dir resumes from the driver's snapshot of its
    # server: every partition's rows of the two epochs are in its weights, and only the third
    # epoch is trained (its tasks skip the rest)
    resumed = result["resumed"]["history"]
    assert resumed[-1]["resumed_rows"] == [EPOCHS * ROWS] * 3
    assert resumed[-1]["partition_rows_applied"] == [(EPOCHS + 1) * ROWS] * 3
    assert resumed[-1]["partition_pushes"] == [ROWS // 8] * 3  # one epoch's pushes each
    assert result["resumed"]["accuracy"] >= killed["accuracy"] - 0.05
    # held-out accuracy within noise of the undisturbed run
    assert calm["accuracy"] > 0.85
    assert abs(killed["accuracy"] - calm["accuracy"]) < 0.05, (calm["accuracy"], killed["accuracy"])
    assert_ssp_counts_only_the_live_tasks(result["ssp killed"], calm)


def assert_ssp_counts_only_the_live_tasks(ssp: dict, calm: dict) -> None:
    """Under ssp (staleness 1) the dead task holds nobody back: the others' pushes never
    pause past the bound while partition 1 is retried, its retry joins at their clock, and
    every row of every epoch is trained once."""
    last = ssp["history"][-1]
    assert [r["partition"] for r in last["task_retries"]] == [1]
    assert last["partition_rows_applied"] == [EPOCHS * ROWS] * 3
    gaps = last["partition_push_gap_max_s"]
    assert gaps[0] < GAP_BOUND_S and gaps[2] < GAP_BOUND_S, gaps
    assert max(gaps[0], gaps[2]) < gaps[1], gaps  # they did not wait out partition 1's restart
    assert abs(ssp["accuracy"] - calm["accuracy"]) < 0.05, (calm["accuracy"], ssp["accuracy"])
