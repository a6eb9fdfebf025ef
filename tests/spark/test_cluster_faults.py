"""Faults that need executors in their own JVMs: a local-cluster in a child process."""

from __future__ import annotations

import pytest

from tests.spark.processes import run_drill

pytestmark = [pytest.mark.spark, pytest.mark.slow]


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
