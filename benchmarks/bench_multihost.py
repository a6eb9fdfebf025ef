"""Every strategy across separate hosts (issue 32, items 1 and 4), against bare torchrun + DDP
across the same hosts on the same link.

A netlab cluster: the driver and a standalone master on host 0, a standalone worker of 2
slots on each of hosts 1 and 2 (own addresses, PIDs and /dev/shm; rate-limited switch
ports). Each variant fits the benchmark MLP (benchmarks/common.py) on 4 workers; for each:
samples/s over epochs 2+, held-out accuracy, the answer's distance to flat all-reduce's
(the exact strategies must agree), the bytes sparkdl says crossed hosts, and the bytes the
switch counted from the worker hosts' ports during the fit (Spark's own traffic included).
Then ``torchrun --nnodes 2 --nproc_per_node 2`` runs benchmarks/ddp_baseline.py on hosts 1
and 2 (gloo over their eth0), on the same rows, batch and epochs.

    ../shared/tools/netlab --hosts 3 --rate 1gbit --isolate -- \\
        .venv/bin/python benchmarks/bench_multihost.py --rate 1gbit [--rows 40000] [--only ...] [--advise]

``--advise`` first runs ``sparkdl.advise`` on the same cluster and data, and puts its predicted
samples/s beside each measured one (issue 32, item 4).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from common import make_model, make_table, save_report  # noqa: E402

from sparkdl import TorchEstimator  # noqa: E402
from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402
from tests.multihost.netlab_drill import HOSTS, MASTER, SESSION, start_cluster, stop_cluster  # noqa: E402

EXACT = "allreduce"  # the variants marked exact must give its weights (within 1e-5)
VARIANTS: list[tuple[str, dict, bool]] = [
    ("allreduce", {"strategy": "allreduce"}, True),  # flat: gloo across hosts, each rank alone
    ("allreduce hierarchy=host", {"strategy": "allreduce", "hierarchy": "host"}, True),
    ("allreduce 1bit", {"strategy": "allreduce", "compression": "1bit"}, False),
    ("allreduce powersgd", {"strategy": "allreduce", "compression": "powersgd"}, False),
    ("fsdp", {"strategy": "fsdp"}, True),
    ("weight_averaging tau=4", {"strategy": "weight_averaging", "sync_every": 4, "hierarchy": "host"}, False),
    (
        "weight_averaging tau=4 1bit",
        {"strategy": "weight_averaging", "sync_every": 4, "compression": "1bit"},
        False,
    ),
    ("parameter_server sync", {"strategy": "parameter_server", "ps_mode": "sync"}, True),
    ("parameter_server ssp s=2", {"strategy": "parameter_server", "ps_mode": "ssp", "staleness": 2}, False),
    ("parameter_server async", {"strategy": "parameter_server", "ps_mode": "async"}, False),
    ("parameter_server sync 1 backup", {"strategy": "parameter_server", "backup_workers": 1}, False),
]


#: Fitted again with host 2's port at a tenth of the link (item 2's slow port): backup workers
#: should keep the fast host's pace.
SLOW_PORT_VARIANTS: list[tuple[str, dict]] = [
    ("parameter_server sync, host 2 at 1/10", {"strategy": "parameter_server"}),
    (
        "parameter_server sync 2 backups, host 2 at 1/10",
        {"strategy": "parameter_server", "backup_workers": 2},
    ),
]


def tenth(rate: str) -> str:
    """``1gbit`` -> ``100mbit``: a tenth of a tc rate."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return f"{int(float(rate[: -len(unit)]) * scale / 10 / 1e6)}mbit"
    raise ValueError(f"--rate {rate!r}: give kbit, mbit or gbit")


def dataframe(spark, rows: int, seed: int):
    """The synthetic data set in 4 cached partitions, one per worker."""
    df = spark.createDataFrame(make_table(rows, seed)).repartition(4).cache()
    df.count()
    return df


def switch_bytes() -> dict[str, int]:
    """Bytes the switch received on each worker host's port (what hosts 1 and 2 sent)."""
    prefix = os.environ["NETLAB_PREFIX"]
    counts = {}
    for host in (1, 2):
        shown = subprocess.run(
            ["ip", "netns", "exec", f"{prefix}-sw", "ip", "-s", "-j", "link", "show", f"p{host}"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        counts[f"host{host}"] = int(json.loads(shown.stdout)[0]["stats64"]["rx"]["bytes"])
    return counts


def bench_estimator(epochs: int, batch_size: int, **settings) -> TorchEstimator:
    return TorchEstimator(
        model_fn=make_model, feature_cols=["features"], num_workers=4, batch_size=batch_size, epochs=epochs,
        seed=0, optimizer="sgd", lr=0.05, momentum=0.0, shuffle=False, progress=False,
        collective_timeout_s=120.0, executor_wait_timeout_s=120.0, **settings,
    )  # fmt: skip


#: The bench's variants as the advisor's rows name them (with the estimator's hierarchy, none,
#: across hosts it probes all-reduce through the host level too)
ADVISOR_ROWS = {
    "allreduce": "allreduce",
    "allreduce hierarchy=host": "allreduce hierarchy=host",
    "allreduce 1bit": "allreduce 1bit",
    "fsdp": "fsdp",
    "weight_averaging tau=4 1bit": "weight_averaging tau=4 1bit",
    "parameter_server sync": "parameter_server sync",
    "parameter_server ssp s=2": "parameter_server ssp s=2",
    "parameter_server async": "parameter_server async",
}


def advise_across_hosts(train_df, epochs: int, batch_size: int) -> dict:
    """``sparkdl.advise`` on the cluster, with the bench's model and settings: its
    predicted samples/s for the variants it has a row for, and what it recommends."""
    from sparkdl import advise

    started = time.perf_counter()
    advice = advise(train_df, bench_estimator(epochs, batch_size))
    print(advice, flush=True)
    return {
        "probe_s": time.perf_counter() - started,
        "recommended": advice.recommended.name,
        "fastest": advice.fastest.name,
        "predicted_samples_per_s": {
            variant: advice.prediction(row).samples_per_s for variant, row in ADVISOR_ROWS.items()
        },
        "advice": advice.to_dict(),
    }


def fit(train_df, test_df, settings: dict, epochs: int, batch_size: int) -> tuple[dict, dict]:
    before = switch_bytes()
    started = time.perf_counter()
    model = bench_estimator(epochs, batch_size, **settings).fit(train_df)
    seconds = time.perf_counter() - started
    after = switch_bytes()
    later = model.history[1:]
    rows = model.transform(test_df).select("label", "prediction").collect()
    across = [sum(h.get("worker_bytes_across_hosts", [0] * 4)[r] for h in model.history) for r in range(4)]
    return {
        "fit_s": seconds,
        "samples_per_s_epochs_2plus": sum(h["samples"] for h in later) / sum(h["seconds"] for h in later),
        "test_accuracy": sum(int(r[0] == r[1]) for r in rows) / len(rows),
        "bytes_across_hosts_reported": sum(across),  # hierarchy and the parameter server count it
        "bytes_sent_reported": sum(h["bytes_sent"] for h in model.history) * 4,  # rank 0's, times the workers
        "bytes_switch_counted": sum(after[k] - before[k] for k in after),
        "exchange": sorted({d.get("exchange", "") for d in model.worker_devices}),
        "hosts": sorted({d["host"] for d in model.worker_devices}),
    }, model.module.state_dict()


def torchrun_baseline(rows: int, epochs: int, batch_size: int) -> dict:
    """benchmarks/ddp_baseline.py on hosts 1 and 2, 2 processes each, over their eth0."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
        "--master_addr", HOSTS[1], "--master_port", "29411",
    ]  # fmt: skip
    script = [str(HERE / "ddp_baseline.py"), "--rows", str(rows), "--epochs", str(epochs),
              "--batch-size", str(batch_size)]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            ["netlab", "exec", str(host), "--", *command, "--node_rank", str(host - 1), *script],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host in (1, 2)
    ]
    outputs = [node.communicate(timeout=900) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        if node.returncode:
            raise RuntimeError(f"torchrun failed: {err[-2000:]}")
    line = [ln for ln in outputs[0][0].splitlines() if ln.startswith("{")][-1]
    return json.loads(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", required=True, help="the link speed netlab was started with (recorded)")
    parser.add_argument("--rows", type=int, default=40_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--only", default="", help="comma-separated variant names (allreduce always runs)")
    parser.add_argument("--slow-port", action="store_true", help="also fit with host 2's port at 1/10")
    parser.add_argument("--advise", action="store_true", help="first, the advisor's predictions")
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    wanted = {EXACT, *filter(None, args.only.split(","))}
    out = Path(args.output or HERE / f"results/multihost_{args.rate}.json")
    work = Path(f"/tmp/bench-multihost-{os.getpid()}")
    os.environ["SPARK_LOCAL_IP"] = HOSTS[0]
    cluster = start_cluster(work)
    results: dict[str, dict] = {}
    try:
        spark = build_session(MASTER, "sparkdl-bench-multihost", SparkDLConfig(), SESSION)
        spark.sparkContext.setLogLevel("ERROR")
        spark.sparkContext.addPyFile(str(HERE / "common.py"))
        train_df, test_df = dataframe(spark, args.rows, seed=0), dataframe(spark, 4000, seed=1)
        advice = advise_across_hosts(train_df, args.epochs, args.batch_size) if args.advise else None
        exact_state = None
        for name, settings, exact in VARIANTS:
            if args.only and name not in wanted:
                continue
            result, state = fit(train_df, test_df, settings, args.epochs, args.batch_size)
            if name == EXACT:
                exact_state = state
            elif exact and exact_state is not None:
                result["max_abs_diff_vs_allreduce"] = max(
                    float((state[k] - exact_state[k]).abs().max()) for k in exact_state
                )
            results[name] = result
            print(name, json.dumps(result), flush=True)
        if args.slow_port:
            subprocess.run(["netlab", "rate", "2", tenth(args.rate)], check=True)
            try:
                for name, settings in SLOW_PORT_VARIANTS:
                    results[name], _ = fit(train_df, test_df, settings, args.epochs, args.batch_size)
                    print(name, json.dumps(results[name]), flush=True)
            finally:
                subprocess.run(["netlab", "rate", "2", args.rate], check=True)
        spark.stop()
    finally:
        stop_cluster(cluster)
    baseline = torchrun_baseline(args.rows, args.epochs, args.batch_size)
    for name, result in results.items():
        result["samples_per_s_vs_torchrun_ddp"] = (
            result["samples_per_s_epochs_2plus"] / baseline["samples_per_s"]
        )
        if advice is not None and name in advice["predicted_samples_per_s"]:
            predicted = advice["predicted_samples_per_s"][name]
            result["advisor_predicted_samples_per_s"] = predicted
            result["advisor_predicted_over_measured"] = predicted / result["samples_per_s_epochs_2plus"]
    save_report(
        str(out),
        setup={
            "link": args.rate,
            "hosts": "driver + master on host 0; 2 worker hosts x 2 slots (netlab --isolate)",
            "workers": 4,
            "rows": args.rows,
            "epochs": args.epochs,
            "batch_size_per_worker": args.batch_size,
            "model": "MLP 64-256-256-10 (benchmarks/common.py), SGD lr 0.05",
        },
        torchrun_ddp=baseline,
        advisor=advice,
        results=results,
    )


if __name__ == "__main__":
    main()
