"""``sparkdl.session``: its warm-up runs only where cores are to spare, and an interpreter
that exits while it runs stops it cleanly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sparkdl.spark.session import has_spare_cores
from tests.spark.processes import ROOT, spark_env

pytestmark = pytest.mark.spark


def test_the_warm_up_runs_only_where_the_executors_leave_cores_to_spare():
    assert not has_spare_cores("local[2]", 2, cores=2)  # this machine: it would compete with the user
    assert not has_spare_cores("local[*]", 16, cores=16)
    assert not has_spare_cores("local-cluster[2,1,1024]", 2, cores=3)
    assert has_spare_cores("local[2]", 2, cores=4)
    assert has_spare_cores("spark://master:7077", 64, cores=2)  # the executors are other machines


_EXIT_DURING_WARM_UP = """
import sys
import sparkdl.spark.session as session
session.has_spare_cores = lambda *args, **kwargs: True  # warm up even on 2 cores
session._STOP_WAIT_S = float(sys.argv[1])  # 0: the exit cancels the warm-up at once
spark = session.session("local[2]", "exit-during-warm-up", **{"spark.ui.enabled": "false"})
thread_started = any(t.name == "sparkdl-warm-up" for t in __import__("threading").enumerate())
print("warming", thread_started, flush=True)
sys.exit(0)  # at once: the warm-up's jobs are still running
"""


@pytest.mark.parametrize("stop_wait_s", [30.0, 0.0], ids=["let-it-finish", "cancelled"])
def test_exiting_while_the_warm_up_runs_logs_no_error_from_its_tasks(tmp_path, stop_wait_s):
    """An exit waits for the warm-up; one that cannot wait (a loaded machine took longer than
    the 30 s bound) cancels it, and its killed tasks still report before the interpreter's
    accumulator server closes (else Spark logs "Failed to update accumulator" as an ERROR)."""
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_DURING_WARM_UP, str(stop_wait_s)],
        env=spark_env(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warming True" in done.stdout
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert not errors, errors
