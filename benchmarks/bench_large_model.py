"""A 500M-parameter model (2 GB of float32) on a default local session: fit, transform,
save, load; the driver's peak memory per phase; returning the weights against a bare socket.

    .venv/bin/python benchmarks/bench_large_model.py [--width 22360] [--repeats 3]

Part 1 runs the whole life of the model on ``local[2]`` with Spark's default memory (the
driver's JVM heap 1 GB, no setting changed) and reads this driver process's peak resident
memory (``VmHWM``, reset before each phase through ``/proc/self/clear_refs``), as a multiple
of the model's bytes.

Part 2 moves the same 2 GB from a child process (as rank 0 does) into this process three
ways, interleaved: the weights channel's upload (authenticated frames read straight into
freshly allocated tensors), and a bare loopback socket receiving into a freshly allocated
buffer, and into a buffer already touched (the socket alone, no page faults). The ratio the
issue asks for is upload / bare into fresh memory: both pay for the memory they fill.
Results: benchmarks/results/large_model.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import save_report  # noqa: E402

WIDTH = 22_360  # Linear(WIDTH, WIDTH): 500M weights


def make_big_net(width: int = WIDTH) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, width), torch.nn.Linear(width, width), torch.nn.Linear(width, 2)]
    return torch.nn.Sequential(*layers)


def _status(field: str) -> int:
    """A figure of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class Peaks:
    """The process's peak RSS per phase (the kernel's high-water mark, reset per phase)."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}

    def run(self, name: str, fn: Any) -> Any:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        started = time.perf_counter()
        result = fn()
        seconds = round(time.perf_counter() - started, 2)
        self.phases[name] = {"seconds": seconds, "peak_rss_gb": round(_status("VmHWM") / 1e9, 2)}
        print(name, self.phases[name], flush=True)
        return result


def part1(width: int) -> dict[str, Any]:
    from sparkdl import TorchEstimator, TorchModel
    from sparkdl.config import SparkDLConfig
    from sparkdl.spark.session import build_session

    spark = build_session("local[2]", "sparkdl-bench-large", SparkDLConfig(), {"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    model_bytes = sum(p.numel() * 4 for p in make_big_net(width).parameters())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    df = spark.createDataFrame([(r.tolist(), int(r[0] > 0)) for r in x], "features array<float>, label long")
    df.cache().count()
    baseline = _status("VmRSS")
    peaks = Peaks()
    estimator = TorchEstimator(
        model_fn=lambda: make_big_net(width),
        optimizer_fn=lambda params: torch.optim.SGD(params, lr=1e-5),
        loss_fn="cross_entropy",
        num_workers=2,
        batch_size=16,
        epochs=1,
        shuffle=False,
        progress=False,
        collective_timeout_s=600.0,
    )
    fitted = peaks.run("fit", lambda: estimator.fit(df))
    peaks.run("transform", lambda: fitted.transform(df).select("prediction").collect())
    path = "/tmp/sparkdl-bench-large-model"
    peaks.run("save", lambda: fitted.write().overwrite().save(path))
    fitted = None  # released before the load, as a new session would be
    loaded = peaks.run("load", lambda: TorchModel.load(path, model_fn=lambda: make_big_net(width)))
    peaks.run("transform after load", lambda: loaded.transform(df).select("prediction").collect())
    spark.stop()
    peak = max(p["peak_rss_gb"] for p in peaks.phases.values()) * 1e9
    return {
        "parameters": model_bytes // 4,
        "model_gb": model_bytes / 1e9,
        "driver_rss_before_fit_gb": baseline / 1e9,
        "phases": peaks.phases,
        "driver_peak_over_model_bytes": round(peak / model_bytes, 2),
        "spark_driver_memory": "default (1g)",
    }


# ------------------------------------------------------------------ part 2: the transfer


def _sender(queue: Any, nbytes: int, repeats: int) -> None:
    from sparkdl.services.weights.client import upload

    state = {"weight": torch.randn(nbytes // 4)}
    raw = memoryview(state["weight"].view(torch.uint8).numpy())
    queue.put("ready")
    for _ in range(repeats):
        endpoint, port = queue.get()
        upload(endpoint, state)
        for _ in range(2):  # bare into fresh memory, bare into touched memory
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(raw)


def _receive_bare(server: socket.socket, buffer: memoryview) -> None:
    conn, _ = server.accept()
    with conn:
        got = 0
        while got < buffer.nbytes:
            got += conn.recv_into(buffer[got:], min(8 << 20, buffer.nbytes - got))


def part2(nbytes: int, repeats: int) -> dict[str, Any]:
    from sparkdl.services.weights.server import WeightServer

    server = WeightServer("127.0.0.1")
    bare = socket.create_server(("127.0.0.1", 0))
    queue: Any = mp.get_context("spawn").Queue()
    child = mp.get_context("spawn").Process(target=_sender, args=(queue, nbytes, repeats))
    child.start()
    assert queue.get(timeout=300) == "ready"
    touched = torch.ones(nbytes, dtype=torch.uint8)
    runs: dict[str, list[float]] = {"upload": [], "bare_fresh": [], "bare_touched": []}
    for _ in range(repeats):
        inbox = server.expect_upload()
        queue.put((inbox.endpoint, bare.getsockname()[1]))
        started = time.perf_counter()
        assert inbox.wait(600.0), "the upload did not arrive"
        runs["upload"].append(time.perf_counter() - started)
        assert inbox.take() is not None
        started = time.perf_counter()
        fresh = torch.empty(nbytes, dtype=torch.uint8)
        _receive_bare(bare, memoryview(fresh.numpy()))
        runs["bare_fresh"].append(time.perf_counter() - started)
        del fresh
        started = time.perf_counter()
        _receive_bare(bare, memoryview(touched.numpy()))
        runs["bare_touched"].append(time.perf_counter() - started)
    child.join()
    server.stop()
    medians = {name: statistics.median(times) for name, times in runs.items()}
    return {
        "gigabytes": nbytes / 1e9,
        "seconds": {name: [round(t, 3) for t in times] for name, times in runs.items()},
        "upload_over_bare_fresh": round(medians["upload"] / medians["bare_fresh"], 2),
        "upload_over_bare_touched": round(medians["upload"] / medians["bare_touched"], 2),
        "upload_gb_per_s": round(nbytes / 1e9 / medians["upload"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-fit", action="store_true")
    args = parser.parse_args()
    transfer = part2(args.width * args.width * 4, args.repeats)
    lifecycle = {} if args.skip_fit else part1(args.width)
    save_report(str(ROOT / "benchmarks/results/large_model.json"), transfer=transfer, lifecycle=lifecycle)


if __name__ == "__main__":
    main()
