"""Training across separate hosts: a Spark standalone cluster on a netlab network.

Run inside ``../shared/tools/netlab --hosts 4 --isolate``, on host 0 (the driver's and the
master's): a worker with 2 slots starts on each of hosts 1 and 2, each with its own
address, PID space and /dev/shm, so 4 barrier tasks run on two "machines" joined by a
rate-limited switch. Nothing names a network interface: the process group must bind the
executors' real addresses by itself (a host name resolves to loopback here). Host 3, a
stranger to the cluster, floods a listener of the driver's while the executors connect
(flood_drill.py). Last, a fit with checkpoints has host 2 unplugged past its collective
timeout (cut_drill.py).

    python tests/multihost/netlab_drill.py OUT_DIR     # writes OUT_DIR/result.json
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import pyspark  # noqa: E402

from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402
from tests.reference import make_shards, max_abs_diff, reference_sgd  # noqa: E402
from tests.spark.test_fit import LR, MOMENTUM, estimator, shards_dataframe  # noqa: E402

HOSTS = os.environ["NETLAB_HOSTS"].split()
SPARK = Path(pyspark.__file__).parent
MASTER = f"spark://{HOSTS[0]}:7077"
RUNS = {
    "allreduce host": {"strategy": "allreduce", "hierarchy": "host"},
    "parameter_server sync": {"strategy": "parameter_server", "ps_mode": "sync"},
}
#: The driver's session on host 0, for 4 workers on the two worker hosts.
SESSION = {
    "spark.ui.enabled": "false",
    "spark.driver.host": HOSTS[0],
    "spark.executor.cores": "2",
    "spark.cores.max": "4",
    "spark.executor.memory": "1g",
    "spark.executorEnv.PYTHONPATH": str(ROOT),
    # the executors run this interpreter, which has sparkdl: its daemon forks workers with torch
    # imported, as the clusters guide says to set (a stage re-run then starts in ~1 s, not ~8 s)
    "spark.python.daemon.module": "sparkdl.spark.daemon",
    # an unplugged host's executors are dropped within ~25 s (heartbeats every 2 s, looked at
    # every 5 s); a 15 s cut keeps them (at most 17 s without a heartbeat)
    "spark.network.timeout": "25s",
    "spark.executor.heartbeatInterval": "2s",
    "spark.network.timeoutInterval": "5s",
}


def cut_and_resume(spark, out: Path) -> dict[str, object]:
    from tests.multihost.cut_drill import cut_and_resume as drill

    return drill(spark, out)


def brief_cut(spark, out: Path) -> dict[str, object]:
    from tests.multihost.cut_drill import brief_cut as drill

    return drill(spark, out)


def lose_a_host(spark, out: Path) -> dict[str, object]:
    from tests.multihost.cut_drill import lose_a_host as drill

    return drill(spark, out)


def flood_from_a_stranger(spark, hosts: list[str], out: Path) -> dict[str, object]:
    from tests.multihost.flood_drill import flood_from_a_stranger as drill

    return drill(spark, hosts, out)


def spark_class(cls: str, address: str, *args: str) -> list[str]:
    return [str(SPARK / "bin/spark-class"), cls, "--host", address, "--webui-port", "0", *args]


def start_cluster(out: Path) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARK_HOME": str(SPARK)}
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    processes = [
        subprocess.Popen(
            spark_class("org.apache.spark.deploy.master.Master", HOSTS[0], "--port", "7077"),
            env={**env, "SPARK_LOCAL_IP": HOSTS[0]},
            stdout=open(logs / "master.log", "wb"),
            stderr=subprocess.STDOUT,
        )
    ]
    for host in (1, 2):
        command = spark_class(
            "org.apache.spark.deploy.worker.Worker", HOSTS[host], "--cores", "2", "--memory", "2g", MASTER
        )
        processes.append(
            subprocess.Popen(
                ["netlab", "exec", str(host), "--", "env", f"SPARK_LOCAL_IP={HOSTS[host]}",
                 f"SPARK_WORKER_DIR={out / f'work{host}'}", *command],
                env=env,
                stdout=open(logs / f"worker{host}.log", "wb"),
                stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
    return processes


def main(out: Path) -> None:
    os.environ["SPARK_LOCAL_IP"] = HOSTS[0]
    cluster = start_cluster(out)
    result: dict[str, object] = {"hosts": HOSTS}
    try:
        from tests.multihost.cut_drill import UI

        spark = build_session(
            MASTER, "sparkdl-netlab", SparkDLConfig().replace(collective_timeout_s=60.0), {**SESSION, **UI}
        )
        spark.sparkContext.setLogLevel("ERROR")
        shards = make_shards([48, 40, 56, 32])
        df = shards_dataframe(spark, shards).cache()
        df.count()
        expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, False)
        for name, settings in RUNS.items():
            started = time.monotonic()
            model = estimator(num_workers=4, epochs=2, executor_wait_timeout_s=120.0, **settings).fit(df)
            result[name] = {
                "seconds": time.monotonic() - started,
                "max_abs_diff": max_abs_diff(model.module.state_dict(), expected),
                "devices": model.worker_devices,
                "across": [
                    sum(h.get("worker_bytes_across_hosts", [0] * 4)[r] for h in model.history)
                    for r in range(4)
                ],
            }
        result["flood"] = flood_from_a_stranger(spark, HOSTS, out)
        # last, as they unplug a host: a cut past the collective timeout, and the resume;
        # then a host lost for good, and the fit going on with the other
        result["brief"] = brief_cut(spark, out)
        result["cut"] = cut_and_resume(spark, out)
        result["lost"] = lose_a_host(spark, out)
        spark.stop()
    finally:
        stop_cluster(cluster)
    (out / "result.json").write_text(json.dumps(result, indent=1))


def stop_cluster(processes: list[subprocess.Popen[bytes]]) -> None:
    """Stop the master and the workers. A worker host's process is ``unshare``, which keeps
    a TERM to itself, so the signal goes to every process under it (the worker's JVM, its
    executors); what has not stopped 10 s later is killed."""
    for process in processes:
        for pid in [process.pid, *descendants(process.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for process in processes:
        try:
            process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for pid in [*descendants(process.pid), process.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.wait(10)


def descendants(root: int) -> list[int]:
    """The PIDs of every live process under ``root``, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


if __name__ == "__main__":
    main(Path(sys.argv[1]))
