"""A worker host's cable cut mid-training, for longer than the collective timeout; and
(``--driver``) the driver's own host cut from the workers.

Run inside ``../shared/tools/netlab --hosts 3 --isolate``, on host 0 (the driver's and the
master's), with a standalone worker of 2 slots on each of hosts 1 and 2 (as netlab_drill.py):
once the fit has written the checkpoint of step 8, host 2 is unplugged for ``CUT_S`` seconds
and plugged back. The ranks wait in a collective for a peer that cannot answer: they must
fail within ``collective_timeout_s``, Spark must re-run the stage once the host is back, and
the run must resume from its checkpoint to the reference answer.

    python tests/multihost/cut_drill.py OUT_DIR [--driver]   # writes OUT_DIR/result.json
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402
from sparkdl.storage.checkpoint_store import CheckpointStore  # noqa: E402
from tests.multihost.netlab_drill import HOSTS, MASTER, SESSION, start_cluster, stop_cluster  # noqa: E402
from tests.reference import make_shards, max_abs_diff, reference_sgd  # noqa: E402
from tests.spark.test_fit import LR, MOMENTUM, estimator, shards_dataframe  # noqa: E402

CUT_HOST = 2
CUT_S = 15.0  # longer than the collective timeout below
COLLECTIVE_TIMEOUT_S = 10.0
CUT_AFTER_STEP = 8
CHECKPOINT_EVERY = 4
PS_TIMEOUT_S = 10.0  # the drills' parameter server: a pull waits this long for the others
DRIVER_HOST = 0  # the driver's and the master's
DRIVER_CUT_WAIT_S = 10.0  # executor_wait_timeout_s of the driver's cut: lost slots fail the fit after it
STEP_S = 0.1  # each forward sleeps this long: the fit lasts long enough to be cut in the middle


def slow_tiny_net():
    from tests.multihost.models import SlowTinyNet

    return SlowTinyNet(STEP_S)


class Cutter(threading.Thread):
    """Unplugs ``host`` once the checkpoint of ``CUT_AFTER_STEP`` exists, for
    ``cut_s`` (None: for good; the caller plugs it back after the fit)."""

    def __init__(self, checkpoints: Path, cut_s: float | None = CUT_S, host: int = CUT_HOST) -> None:
        super().__init__(daemon=True)
        self.checkpoints, self.cut_s, self.host = checkpoints, cut_s, host
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
        subprocess.run(["netlab", "cut", str(self.host)], check=True)
        self.cut_at = time.monotonic()
        if self.cut_s is None:
            return
        time.sleep(self.cut_s)
        subprocess.run(["netlab", "heal", str(self.host)], check=True)
        self.healed_at = time.monotonic()


def drill_fit(df, checkpoints: Path, **settings):
    """The drills' fit: the slow TinyNet on 4 workers for 3 epochs, checkpoints every
    ``CHECKPOINT_EVERY`` steps, the drills' timeouts; ``settings`` on top."""
    return estimator(
        model_fn=slow_tiny_net,
        num_workers=4,
        epochs=3,
        checkpoint_dir=str(checkpoints),
        checkpoint_every=CHECKPOINT_EVERY,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        progress=False,
        **{"executor_wait_timeout_s": 120.0, **settings},
    ).fit(df)


def stage_attempts(spark, started: float) -> list[dict[str, object]]:
    """Every stage attempt of the application: when it was submitted and completed (seconds
    after the fit started), its status and why it failed."""
    import datetime
    import urllib.request

    app = spark.sparkContext.applicationId
    url = f"http://{HOSTS[0]}:4088/api/v1/applications/{app}/stages?details=false"

    def read(address: str) -> Any:
        """The UI's answer; on a loaded machine its server can take long: 3 tries of 30 s."""
        for attempt in range(3):
            try:
                with urllib.request.urlopen(address, timeout=30) as answer:
                    return json.load(answer)
            except TimeoutError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    stages = read(url)
    offset = time.time() - (time.monotonic() - started)  # wall time of the fit's start

    def since(stamp: str | None) -> float | None:
        if not stamp:
            return None
        at = datetime.datetime.strptime(stamp.replace("GMT", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z")
        return round(at.timestamp() - offset, 1)

    def tasks(stage: dict) -> list[dict[str, object]]:
        path = f"{url.split('/stages?')[0]}/stages/{stage['stageId']}/{stage['attemptId']}/taskList"
        listed = read(path)
        assert isinstance(listed, list), listed
        return [
            {
                "partition": task["index"],
                "host": task.get("host"),
                "launched_s": since(task.get("launchTime")),
                "seconds": (task.get("duration") or 0) / 1000,
                "status": task.get("status"),
                "error": [
                    line[:400] for line in (task.get("errorMessage") or "").splitlines() if "Error" in line
                ][:3],
            }
            for task in listed
        ]

    return [
        {
            "stage": stage["stageId"],
            "attempt": stage["attemptId"],
            "status": stage["status"],
            "submitted_s": since(stage.get("submissionTime")),
            "completed_s": since(stage.get("completionTime")),
            "tasks": tasks(stage) if stage["numTasks"] == 4 and stage["status"] != "SKIPPED" else [],
        }
        for stage in sorted(stages, key=lambda s: (s["stageId"], s["attemptId"]))
    ]


#: The session settings a cut drill needs besides netlab_drill's: the UI's REST API, which says
#: when each stage attempt ran.
UI = {"spark.ui.enabled": "true", "spark.ui.port": "4088"}


def cut_and_resume(spark, out: Path) -> dict[str, object]:
    """Fit with checkpoints while host ``CUT_HOST`` is unplugged past the collective timeout;
    return what happened: when the cut came and went, the answer's distance to the reference,
    the resume, the warnings with their time, every stage attempt."""
    logs: list[tuple[float, str]] = []  # (monotonic time, message) of sparkdl's records
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: logs.append((time.monotonic(), record.getMessage()))  # type: ignore[method-assign]
    logging.getLogger("sparkdl").addHandler(handler)
    try:
        shards = make_shards([80, 80, 80, 80])  # 10 steps an epoch
        df = shards_dataframe(spark, shards).cache()
        df.count()
        checkpoints = out / "checkpoints"
        cutter = Cutter(checkpoints)
        cutter.start()
        started = time.monotonic()
        model = drill_fit(df, checkpoints, hierarchy="host")
        finished = time.monotonic()
        cutter.join(timeout=60)
    finally:
        logging.getLogger("sparkdl").removeHandler(handler)
    expected = reference_sgd(shards, 8, 3, 0, LR, MOMENTUM, False)
    resumed = [h for h in model.history if "resumed_from_step" in h]
    return {
        "cut_s": CUT_S,
        "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
        "checkpoint_every": CHECKPOINT_EVERY,
        "cut_at_s": cutter.cut_at - started if cutter.cut_at else None,
        "healed_at_s": cutter.healed_at - started if cutter.healed_at else None,
        "fit_s": finished - started,
        "max_abs_diff": max_abs_diff(model.module.state_dict(), expected),
        "resumed": resumed[0] if resumed else None,
        "devices": model.worker_devices,
        "logs": [(round(at - started, 1), message[:600]) for at, message in logs],
        "stages": stage_attempts(spark, started),
    }


#: Shorter than every timeout of the fit: TCP retransmits across it, nothing should notice.
BRIEF_CUT_S = 4.0


def brief_cut(spark, out: Path) -> dict[str, object]:
    """A synchronous parameter server fit (its workers' pushes and pulls cross the switch to
    the driver's host) while host ``CUT_HOST`` is unplugged for ``BRIEF_CUT_S``, shorter than
    the collective, the server's and the stall timeouts: the fit must go on in the same stage
    attempt and every push be applied exactly once (the reference answer)."""
    shards = make_shards([80, 80, 80, 80])
    df = shards_dataframe(spark, shards).cache()
    df.count()
    checkpoints = out / "brief-checkpoints"  # only the cutter's clock: nothing resumes from them
    cutter = Cutter(checkpoints, BRIEF_CUT_S)
    cutter.start()
    started = time.monotonic()
    model = drill_fit(df, checkpoints, strategy="parameter_server")
    finished = time.monotonic()
    cutter.join(timeout=60)
    expected = reference_sgd(shards, 8, 3, 0, LR, MOMENTUM, False)
    return {
        "cut_at_s": cutter.cut_at - started if cutter.cut_at else None,
        "healed_at_s": cutter.healed_at - started if cutter.healed_at else None,
        "fit_s": finished - started,
        "max_abs_diff": max_abs_diff(model.module.state_dict(), expected),
        "resumed": [h for h in model.history if "resumed_from_step" in h],
        "stages": stage_attempts(spark, started),
    }


#: Long enough for Spark to drop the unplugged host's executors, short enough for the drill.
LOST_WAIT_S = 10.0


def lose_a_host(spark, out: Path) -> dict[str, object]:
    """Fit with ``min_workers = 2`` of 4 while host ``CUT_HOST`` is unplugged for good after
    the checkpoint of ``CUT_AFTER_STEP``: once Spark has dropped its executors and the slots
    stayed short for ``LOST_WAIT_S``, the fit must go on with the other host's 2 workers from
    the checkpoint."""
    shards = make_shards([80, 80, 80, 80])  # 10 steps an epoch on 4 workers, 20 on 2
    df = shards_dataframe(spark, shards).cache()
    df.count()
    checkpoints = out / "lost-checkpoints"
    unplugger = Cutter(checkpoints, cut_s=None)
    unplugger.start()
    started = time.monotonic()
    try:
        model = drill_fit(
            df, checkpoints, min_workers=2, hierarchy="host", executor_wait_timeout_s=LOST_WAIT_S
        )
        finished = time.monotonic()
    finally:
        unplugger.join(timeout=60)
        subprocess.run(["netlab", "heal", str(CUT_HOST)], check=True)
    return {
        "cut_at_s": unplugger.cut_at - started if unplugger.cut_at else None,
        "fit_s": finished - started,
        "history": model.history,
        "devices": model.worker_devices,
    }


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (its sockets' inodes matched to the table of
    its network namespace)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def python_connections_to(host: int, address: str) -> list[str]:
    """The established TCP connections that Python processes on netlab host ``host`` hold to
    ``address`` (one line of ``ss`` each). Host 0's view of /proc sees every host's processes."""
    namespace = f"{os.environ['NETLAB_PREFIX']}-h{host}"
    listed = subprocess.run(
        ["ip", "netns", "exec", namespace, "ss", "-tnpH", "state", "established"],
        capture_output=True, text=True, check=True, timeout=10,
    ).stdout  # fmt: skip
    held = []
    for line in listed.splitlines():  # Recv-Q Send-Q Local:Port Peer:Port users:(("name",pid=..))
        fields = line.split()
        if len(fields) > 4 and fields[3].rsplit(":", 1)[0] == address and '(("python' in fields[4]:
            held.append(line)
    return held


class Holders(threading.Thread):
    """From the cut on, counts every half second the connections the worker hosts' Python
    processes (the training tasks) still hold to the driver's host; ``released_at`` is when
    none is left (bounded: ``limit_s``)."""

    def __init__(self, cutter: Cutter, limit_s: float = 240.0) -> None:
        super().__init__(daemon=True)
        self.cutter, self.limit_s = cutter, limit_s
        self.released_at = 0.0
        self.held: list[tuple[float, int]] = []  # (monotonic time, connections)

    def run(self) -> None:
        deadline = time.monotonic() + self.limit_s
        while not self.cutter.cut_at and time.monotonic() < deadline:
            time.sleep(0.1)
        while time.monotonic() < deadline:
            held = sum(len(python_connections_to(h, HOSTS[0])) for h in (1, 2))
            self.held.append((time.monotonic(), held))
            if held == 0:
                self.released_at = time.monotonic()
                return
            time.sleep(0.5)


def cut_the_driver(spark, out: Path) -> dict[str, object]:
    """A synchronous parameter server fit (every step of every worker crosses to the driver's
    host) while host 0, the driver's and the master's, is unplugged for good after the
    checkpoint of ``CUT_AFTER_STEP``: ``fit`` must raise within a bound, the driver's servers
    of the fit must close, and no task on the worker hosts may go on holding a connection to
    the driver (nothing hangs). The cable is plugged back after."""
    from sparkdl.services.weights.server import weight_server
    from sparkdl.spark.cluster import driver_host

    shards = make_shards([80, 80, 80, 80])
    df = shards_dataframe(spark, shards).cache()
    df.count()
    weight_server(driver_host(spark))  # process-wide, open from the first fit on: not the fit's to close
    before = listening_ports(os.getpid())
    checkpoints = out / "driver-checkpoints"
    cutter = Cutter(checkpoints, cut_s=None, host=DRIVER_HOST)
    holders = Holders(cutter)
    cutter.start()
    holders.start()
    started = time.monotonic()
    error: BaseException | None = None
    try:
        drill_fit(
            df, checkpoints, strategy="parameter_server", ps_timeout_s=PS_TIMEOUT_S,
            executor_wait_timeout_s=DRIVER_CUT_WAIT_S,
        )  # fmt: skip
    except Exception as exc:
        error = exc
    raised = time.monotonic()
    after = listening_ports(os.getpid())
    holders.join(timeout=holders.limit_s + 10)
    subprocess.run(["netlab", "heal", str(DRIVER_HOST)], check=True)
    cutter.join(timeout=10)
    since_cut = lambda at: round(at - cutter.cut_at, 1) if at and cutter.cut_at else None  # noqa: E731
    return {
        "cut_at_s": cutter.cut_at - started if cutter.cut_at else None,
        "raised_after_cut_s": since_cut(raised),
        "error": f"{type(error).__name__}: {error}"[:1500] if error else None,
        "ports_left_open": sorted(after - before),
        "released_after_cut_s": since_cut(holders.released_at),
        "held": [(since_cut(at), n) for at, n in holders.held],
    }


def main(out: Path) -> None:
    cluster = start_cluster(out)
    logging.getLogger("sparkdl").setLevel(logging.DEBUG if "--debug" in sys.argv else logging.WARNING)
    try:
        spark = build_session(
            MASTER,
            "sparkdl-netlab-cut",
            SparkDLConfig().replace(collective_timeout_s=COLLECTIVE_TIMEOUT_S),
            {**SESSION, **UI},
        )
        spark.sparkContext.setLogLevel("ERROR")
        drill = cut_the_driver if "--driver" in sys.argv else cut_and_resume
        result = {"hosts": HOSTS, drill.__name__: drill(spark, out)}
        spark.stop()
    finally:
        stop_cluster(cluster)
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))  # --debug: every sparkdl record; --driver: cut the driver's host instead
