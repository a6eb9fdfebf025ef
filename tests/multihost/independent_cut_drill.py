"""Downpour across hosts (issue 57 item 5): the asynchronous parameter server in ordinary
tasks (``ps_barrier = false``) with a worker host's cable cut for good mid-epoch, against
the same fit undisturbed and against the barrier stage's asynchronous mode under the same cut.

Run inside ``../shared/tools/netlab --hosts 3 --isolate``, on host 0 (the driver's and the
master's), with a standalone worker of 2 slots on each of hosts 1 and 2 (as netlab_drill.py).
4 partitions of a learnable problem, 2 epochs, every forward ``STEP_S`` long. After
``CUT_SHARE`` of the undisturbed fit's time, host 2 is unplugged until the fit ends: its
two tasks' pushes stop, Spark drops its executors (``spark.network.timeout``, 25 s) and
runs the two tasks again on host 1 once its own are done, each skipping the rows its
predecessor's pushes hold. Recorded per fit: its wall time, held-out accuracy, the server's
rows per partition, each partition's longest gap between two pushes and the retries; the
barrier fit's error and when it came.

    python tests/multihost/independent_cut_drill.py OUT_DIR [--speculation]   # OUT_DIR/result.json

``--runs cut,slow,jvm`` (default ``cut``) chooses the disturbances, each fitted as ordinary
tasks and as the barrier stage: ``cut`` as above; ``slow``: partition 3's worker (on host 2)
``SLOW_FACTOR`` times slower than the others, undisturbed otherwise; ``jvm``: the executor JVM
of the first task to reach step ``JVM_KILL_STEP`` (``CUT_SHARE`` of the fit's steps) killed by
its Python worker (``fault_injection = "killjvm:..."``), its host staying up (its standalone
worker starts a new executor).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402
from tests.spark.independent_ps_drill import WIDTH, downpour, problem  # noqa: E402

CUT_HOST = 2
ROWS = 480  # per partition: 60 steps of 8 rows an epoch
EPOCHS = 2
STEP_S = 0.1
#: ``--speculation``: Spark starts a copy of a task running 1.5x the finished ones' median.
SPECULATION = {
    "spark.speculation": "true",
    "spark.speculation.interval": "1s",
    "spark.speculation.multiplier": "1.5",
    "spark.speculation.quantile": "0.5",
}
CUT_SHARE = 0.4  # the cut comes after this share of the undisturbed fit's time: mid-epoch 1
SLOW_PARTITION, SLOW_FACTOR = 3, 3.0
JVM_KILL_STEP = int(CUT_SHARE * EPOCHS * ROWS / 8)  # an independent task's steps: its own partition's


def slow_linear():
    from tests.multihost.models import SlowLinear

    return SlowLinear(WIDTH, 3, STEP_S)


def slow_partition_linear():
    from tests.multihost.models import SlowPartitionLinear

    return SlowPartitionLinear(WIDTH, 3, STEP_S, SLOW_PARTITION, SLOW_FACTOR)


class TimedCut(threading.Thread):
    """Unplugs ``CUT_HOST`` ``after_s`` after it starts, for good (healed by the caller)."""

    def __init__(self, after_s: float) -> None:
        super().__init__(daemon=True)
        self.after_s = after_s
        self.cut_at = 0.0

    def run(self) -> None:
        time.sleep(self.after_s)
        subprocess.run(["netlab", "cut", str(CUT_HOST)], check=True)
        self.cut_at = time.monotonic()


def fit(
    df, held_out, barrier: bool, cut_after_s: float | None, epochs: int = EPOCHS, slow: bool = False,
    kill_jvm: str = "",
) -> dict:  # fmt: skip
    """One fit; ``kill_jvm``: the marker file of a ``killjvm`` drill at ``JVM_KILL_STEP``."""
    drill = {"fault_injection": f"killjvm:0:{JVM_KILL_STEP}:{kill_jvm}"} if kill_jvm else {}
    estimator = downpour(
        slow_partition_linear if slow else slow_linear, 4, epochs, ps_barrier=barrier, ps_timeout_s=20.0,
        executor_wait_timeout_s=20.0, **drill,
    )  # fmt: skip
    cutter = TimedCut(cut_after_s) if cut_after_s is not None else None
    started = time.monotonic()
    if cutter is not None:
        cutter.start()
    record: dict = {"barrier": barrier, "cut_after_s": cut_after_s}
    try:
        model = estimator.fit(df)
    except Exception as exc:  # the barrier stage under the cut: what fit says, and when
        record.update(error=f"{type(exc).__name__}: {str(exc)[:600]}", fit_s=time.monotonic() - started)
    else:
        x, y = held_out
        with torch.no_grad():
            predicted = model.module.eval()(torch.from_numpy(x)).argmax(1).numpy()
        record.update(
            fit_s=time.monotonic() - started,
            accuracy=float((predicted == y).mean()),
            history=model.history,
            devices=model.worker_devices,
        )
    finally:
        if cutter is not None:
            cutter.join(timeout=60)
            subprocess.run(["netlab", "heal", str(CUT_HOST)], check=True)
            record["cut_at_s"] = cutter.cut_at - started if cutter.cut_at else None
        if cutter is not None or kill_jvm:
            time.sleep(30)  # the healed host's worker (or the new executor) registers before the next fit
    return record


def main(out: Path) -> None:
    # here, not at the top: the test reads this module's constants outside netlab
    from tests.multihost.netlab_drill import HOSTS, MASTER, SESSION, start_cluster, stop_cluster

    cluster = start_cluster(out)
    result: dict = {"hosts": HOSTS}
    try:
        session = {**SESSION, "spark.task.maxFailures": "4"}
        if "--speculation" in sys.argv:  # a copy of a task that lags the others' median 1.5x
            session.update(SPECULATION)
        spark = build_session(MASTER, "sparkdl-netlab-independent", SparkDLConfig(), session)
        spark.sparkContext.setLogLevel("ERROR")
        from pyspark.sql import Row

        parts = [problem(seed, ROWS) for seed in (1, 2, 3, 4)]
        rows = [
            [Row(features=[float(v) for v in x[i]], label=int(y[i])) for i in range(ROWS)] for x, y in parts
        ]
        rdd = spark.sparkContext.parallelize(range(4), 4).flatMap(lambda i: rows[i])
        df = spark.createDataFrame(
            rdd, "features array<float>, label long"
        ).cache()  # a lost host's blocks are recomputed
        df.count()
        held_out = problem(9, 600)
        fit(df, held_out, barrier=False, cut_after_s=None, epochs=1)  # the session's first fit: warm-up
        result["undisturbed"] = undisturbed = fit(df, held_out, barrier=False, cut_after_s=None)
        cut_after_s = CUT_SHARE * undisturbed["fit_s"]
        runs = sys.argv[sys.argv.index("--runs") + 1].split(",") if "--runs" in sys.argv else ["cut"]
        if "slow" in runs:
            result["barrier undisturbed"] = fit(df, held_out, barrier=True, cut_after_s=None)
            result["independent slow"] = fit(df, held_out, barrier=False, cut_after_s=None, slow=True)
            result["barrier slow"] = fit(df, held_out, barrier=True, cut_after_s=None, slow=True)
        if "jvm" in runs:
            killed = str(out / "killed-independent")
            result["independent jvm"] = fit(df, held_out, False, None, kill_jvm=killed)
            result["barrier jvm"] = fit(df, held_out, True, None, kill_jvm=str(out / "killed-barrier"))
        if "cut" in runs:  # last: a host unplugged for good
            result["independent cut"] = fit(df, held_out, barrier=False, cut_after_s=cut_after_s)
            result["barrier cut"] = fit(df, held_out, barrier=True, cut_after_s=cut_after_s)
        spark.stop()
    finally:
        stop_cluster(cluster)
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    np.random.seed(0)
    main(Path(sys.argv[1]))
