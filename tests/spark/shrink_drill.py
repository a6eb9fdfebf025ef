"""Drill: a standalone worker lost for good mid-fit; the fit goes on with the one left.

A master and two workers of one core each, started with PySpark's own scripts on
loopback (tests/spark/test_standalone_cluster.py's cluster). The fit has 2 workers,
``min_workers = 1`` and checkpoints every 4 steps; once the checkpoint of step 8 exists,
worker 2's daemon is killed (SIGKILL: its executor follows it), and nothing restarts it.
The stage cannot be re-run on two slots: fit must cancel it once the slots have been short
for ``executor_wait_timeout_s``, and go on with one worker from the checkpoint.

Run by tests/spark/test_cluster_faults.py in its own process:
python tests/spark/shrink_drill.py OUT_DIR
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402
from sparkdl.storage.checkpoint_store import CheckpointStore  # noqa: E402
from tests.reference import make_shards  # noqa: E402
from tests.spark.test_fit import estimator, shards_dataframe  # noqa: E402
from tests.spark.test_standalone_cluster import WORKER, StandaloneCluster  # noqa: E402

KILL_AFTER_STEP = 8
STEP_S = 0.05  # each forward sleeps this long: the fit lasts long enough to lose a worker in it
WAIT_S = 5.0  # executor_wait_timeout_s: how long fit waits for the slots to come back


def slow_tiny_net():
    from tests.multihost.models import SlowTinyNet

    return SlowTinyNet(STEP_S)


class Killer(threading.Thread):
    """SIGKILLs worker 2's daemon once the checkpoint of ``KILL_AFTER_STEP`` exists."""

    def __init__(self, checkpoints: Path, pid_file: Path) -> None:
        super().__init__(daemon=True)
        self.checkpoints, self.pid_file = checkpoints, pid_file
        self.killed_at = 0.0

    def run(self) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            latest = CheckpointStore(str(self.checkpoints)).latest() if self.checkpoints.exists() else None
            if latest is not None and latest >= KILL_AFTER_STEP:
                os.kill(int(self.pid_file.read_text().strip()), signal.SIGKILL)
                self.killed_at = time.monotonic()
                return
            time.sleep(0.02)


def main(out: Path) -> None:
    cluster = StandaloneCluster(out)
    cluster.start()
    logs: list[tuple[float, str]] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logs.append((time.monotonic(), record.getMessage()))  # type: ignore[method-assign]
    logging.getLogger("sparkdl").addHandler(handler)
    logging.getLogger("sparkdl").setLevel(logging.INFO)
    try:
        spark = build_session(
            cluster.url,
            "sparkdl-shrink",
            SparkDLConfig().replace(collective_timeout_s=10.0),
            {
                "spark.ui.enabled": "false",
                "spark.driver.host": "127.0.0.1",
                "spark.executor.cores": "1",
                "spark.executor.memory": "1g",
                # the executors run this interpreter: its workers fork with torch imported, as
                # the clusters guide says to set
                "spark.python.daemon.module": "sparkdl.spark.daemon",
            },
        )
        spark.sparkContext.setLogLevel("ERROR")
        shards = make_shards([96, 96])  # 12 steps an epoch on 2 workers
        df = shards_dataframe(spark, shards).cache()
        df.count()
        checkpoints = out / "checkpoints"
        pid_file = out / "pids" / f"spark-sparkdl-test-{WORKER}-2.pid"
        killer = Killer(checkpoints, pid_file)
        killer.start()
        started = time.monotonic()
        model = estimator(
            model_fn=slow_tiny_net,
            num_workers=2,
            min_workers=1,
            epochs=3,
            checkpoint_dir=str(checkpoints),
            checkpoint_every=4,
            collective_timeout_s=10.0,
            executor_wait_timeout_s=WAIT_S,
            progress=False,
        ).fit(df)
        finished = time.monotonic()
        result = {
            "killed_at_s": killer.killed_at - started if killer.killed_at else None,
            "fit_s": finished - started,
            "history": model.history,
            "devices": model.worker_devices,
            "logs": [(round(at - started, 1), message[:400]) for at, message in logs],
        }
        spark.stop()
    finally:
        logging.getLogger("sparkdl").removeHandler(handler)
        cluster.stop()  # worker 2 is gone: spark-daemon.sh says so and goes on
    (out / "result.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
