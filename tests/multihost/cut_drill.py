"""A worker host's cable cut mid-training, for longer than the collective timeout.

Run inside ``../shared/tools/netlab --hosts 3 --isolate``, on host 0 (the driver's and the
master's), with a standalone worker of 2 slots on each of hosts 1 and 2 (as netlab_drill.py):
once the fit has written the checkpoint of step 8, host 2 is unplugged for ``CUT_S`` seconds
and plugged back. The ranks wait in a collective for a peer that cannot answer: they must
fail within ``collective_timeout_s``, Spark must re-run the stage once the host is back, and
the run must resume from its checkpoint to the reference answer.

    python tests/multihost/cut_drill.py OUT_DIR     # writes OUT_DIR/result.json
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402
from sparkdl.storage.checkpoint_store import CheckpointStore  # noqa: E402
from tests.multihost.netlab_drill import HOSTS, MASTER, start_cluster, stop_cluster  # noqa: E402
from tests.reference import make_shards, max_abs_diff, reference_sgd  # noqa: E402
from tests.spark.test_fit import LR, MOMENTUM, estimator, shards_dataframe  # noqa: E402

CUT_HOST = 2
CUT_S = 25.0  # longer than the collective timeout below
COLLECTIVE_TIMEOUT_S = 10.0
CUT_AFTER_STEP = 8
CHECKPOINT_EVERY = 4
STEP_S = 0.1  # each forward sleeps this long: the fit lasts long enough to be cut in the middle


def slow_tiny_net():
    from tests.multihost.models import SlowTinyNet

    return SlowTinyNet(STEP_S)


class Cutter(threading.Thread):
    """Unplugs host ``CUT_HOST`` once the checkpoint of ``CUT_AFTER_STEP`` exists, for ``CUT_S``."""

    def __init__(self, checkpoints: Path) -> None:
        super().__init__(daemon=True)
        self.checkpoints = checkpoints
        self.cut_at = self.healed_at = 0.0

    def run(self) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            latest = CheckpointStore(str(self.checkpoints)).latest() if self.checkpoints.exists() else None
            if latest is not None and latest >= CUT_AFTER_STEP:
                break
            time.sleep(0.05)
        else:
            return
        subprocess.run(["netlab", "cut", str(CUT_HOST)], check=True)
        self.cut_at = time.monotonic()
        time.sleep(CUT_S)
        subprocess.run(["netlab", "heal", str(CUT_HOST)], check=True)
        self.healed_at = time.monotonic()


def main(out: Path) -> None:
    cluster = start_cluster(out)
    result: dict[str, object] = {"hosts": HOSTS}
    logs: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logs.append(f"{time.monotonic():.1f} {record.getMessage()}")  # type: ignore[method-assign]
    logging.getLogger("sparkdl").addHandler(handler)
    logging.getLogger("sparkdl").setLevel(logging.INFO)
    try:
        spark = build_session(
            MASTER,
            "sparkdl-netlab-cut",
            SparkDLConfig().replace(collective_timeout_s=COLLECTIVE_TIMEOUT_S),
            {
                "spark.ui.enabled": "false",
                "spark.driver.host": HOSTS[0],
                "spark.executor.cores": "2",
                "spark.cores.max": "4",
                "spark.executor.memory": "1g",
                "spark.executorEnv.PYTHONPATH": str(ROOT),
            },
        )
        spark.sparkContext.setLogLevel("ERROR")
        shards = make_shards([80, 80, 80, 80])  # 10 steps an epoch
        df = shards_dataframe(spark, shards).cache()
        df.count()
        checkpoints = out / "checkpoints"
        cutter = Cutter(checkpoints)
        cutter.start()
        started = time.monotonic()
        model = estimator(
            model_fn=slow_tiny_net,
            num_workers=4,
            epochs=3,
            hierarchy="host",
            checkpoint_dir=str(checkpoints),
            checkpoint_every=CHECKPOINT_EVERY,
            collective_timeout_s=COLLECTIVE_TIMEOUT_S,
            executor_wait_timeout_s=120.0,
            progress=False,
        ).fit(df)
        finished = time.monotonic()
        cutter.join(timeout=60)
        expected = reference_sgd(shards, 8, 3, 0, LR, MOMENTUM, False)
        resumed = [h for h in model.history if "resumed_from_step" in h]
        result.update(
            {
                "cut_s": CUT_S,
                "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
                "cut_at_s": cutter.cut_at - started if cutter.cut_at else None,
                "healed_at_s": cutter.healed_at - started if cutter.healed_at else None,
                "fit_s": finished - started,
                "max_abs_diff": max_abs_diff(model.module.state_dict(), expected),
                "resumed": resumed[0] if resumed else None,
                "devices": model.worker_devices,
                "logs": [line for line in logs if "attempt" in line or "failed" in line or "resum" in line],
            }
        )
        spark.stop()
    finally:
        stop_cluster(cluster)
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
