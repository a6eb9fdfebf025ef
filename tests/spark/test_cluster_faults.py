"""Faults that need executors in their own JVMs: a local-cluster in a child process."""

from __future__ import annotations

import pytest

from tests.multihost.test_netlab import netlab_missing
from tests.spark.processes import run_drill

pytestmark = [pytest.mark.spark, pytest.mark.slow]

#: The netlab drill's lost host (tests/multihost/test_netlab.py) is this test's twin across real
#: hosts: a worker lost for good, the fit going on with the workers left from the checkpoint,
#: every row of every epoch trained and the history saying so. Where netlab runs (root), it
#: stands for both in the default run and this one is in the fault_drill tier (``pytest -m
#: fault_drill tests/spark/test_cluster_faults.py``); where it cannot, this one runs by default.
twinned_across_hosts = pytest.mark.fault_drill if not netlab_missing() else pytest.mark.slow


#: Likewise the netlab drill's cut and lost host stand for an executor JVM's death: a stage
#: that lost workers re-run by Spark and resumed from the checkpoint to the reference weights
#: (cut), executors Spark dropped and the fit resumed from the checkpoint (lost host).
@twinned_across_hosts
def test_losing_an_executor_jvm_resumes_from_the_checkpoint_with_identical_weights(tmp_path):
    result = run_drill("executor_loss_drill.py", tmp_path)
    assert result["fired"]
    assert result["max_abs_diff"] == 0.0
    resumed = result["resumed"]
    assert resumed["resumed_from_step"] == 8 and resumed["steps_redone"] == 2
    print(
        f"FIGURE executor-loss redone={resumed['steps_redone']} recovery_s={resumed['recovery_s']:.2f} "
        f"clean_s={result['clean_s']:.2f} drilled_s={result['drilled_s']:.2f}"
    )


@twinned_across_hosts
def test_a_worker_lost_for_good_leaves_the_fit_to_go_on_with_the_one_left(tmp_path):
    """A standalone worker killed after the checkpoint of step 8 (min_workers = 1): fit
    cancels the stage that waits for its slot, resumes from the checkpoint on one worker,
    and says so in the history."""
    result = run_drill("shrink_drill.py", tmp_path)
    assert result["killed_at_s"] is not None
    history = result["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3]
    (resized,) = [h for h in history if "lost_workers" in h]
    assert resized["workers"] == 1 and resized["lost_workers"] == 1
    assert resized["resumed_from_step"] >= 8
    assert len(result["devices"]) == 1  # the last stage ran on the worker left
    # the data split anew: epoch 1 starts over on the checkpoint's weights, every row of every
    # epoch on the one worker
    assert [h["worker_samples"] for h in history] == [[192], [192], [192]]
    # the watch cancelled the stage waiting for the lost slot (not the stall bound, 100 s)
    assert any("fit cancelled the stage" in message for _, message in result["logs"]), result["logs"]
    assert result["fit_s"] - result["killed_at_s"] < 45, result
    print(f"FIGURE shrink killed_at_s={result['killed_at_s']:.1f} fit_s={result['fit_s']:.1f}")
