"""The streaming job's end-to-end latency per micro-batch (issue 56 item 3): from a Parquet
file landing in the watched directory to its model version published.

Runs the real job (:func:`sparkdl.apps.stream_job.run_stream_job`, ``conf/stream.toml`` with
``trigger = "processing_time"``) on a thread, then lands the bundled digits' files one at a
time (written elsewhere, renamed in: a file appears whole), each after the version of the one
before is published, so no file waits behind another. Latency is the version's manifest
``published_at`` minus the landing time; its part spent in ``fit`` is the manifest's
``fit_seconds``; the rest is the trigger's wait, the file listing, the empty check, the
save, the manifest and ``LATEST``. The first micro-batch (the session's first fit) is
reported apart.

    .venv/bin/python benchmarks/bench_streaming.py [--files 8] [--interval 1.0] [--epochs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import save_report  # noqa: E402
from sparkdl.apps.stream_job import load_stream_config, run_stream_job, write_sample_files  # noqa: E402
from sparkdl.ml.streaming import read_manifest, version_path  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402


def wait_for(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"{what} did not happen within {timeout_s} s; raise --timeout")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=8, help="micro-batches: the digits split into this many")
    parser.add_argument("--interval", type=float, default=1.0, help="stream.trigger_interval_s")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per micro-batch")
    parser.add_argument("--timeout", type=float, default=300.0, help="the longest wait for one version")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/streaming.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as folder:
        staged = write_sample_files(Path(folder) / "staged", args.files)
        watched = Path(folder) / "in"
        watched.mkdir()
        config = load_stream_config(
            ROOT / "conf/stream.toml",
            [
                f"stream.input_path={watched}",
                "stream.write_sample=false",
                "stream.trigger=processing_time",
                f"stream.trigger_interval_s={args.interval}",
                f"stream.run_for_s={args.timeout * (args.files + 1)}",
                f"training.epochs={args.epochs}",
                "runtime.progress=false",
            ],
        )
        out = Path(folder) / "out"
        spark = build_session(config.spark.master, config.spark.app_name, config.sparkdl, config.spark.conf)
        spark.sparkContext.setLogLevel("ERROR")
        job = threading.Thread(
            target=run_stream_job, args=(config, out, spark), name="stream-job", daemon=True
        )
        job.start()
        wait_for(lambda: spark.streams.active, args.timeout, "the query's start")
        batches = []
        for k, file in enumerate(staged):
            landed = time.time()
            os.rename(file, watched / file.name)
            manifest = wait_for(
                lambda k=k: read_manifest(spark, version_path(str(out / "models"), k)),
                args.timeout,
                f"micro-batch {k}'s version",
            )
            latency = manifest["published_at"] - landed
            batches.append(
                {
                    "batch_id": k,
                    "rows": manifest["samples"],
                    "latency_s": latency,
                    "fit_s": manifest["fit_seconds"],
                }
            )
            print(json.dumps(batches[-1]))
        for query in spark.streams.active:
            query.stop()
        job.join(timeout=args.timeout)
    later = batches[1:]
    median = {key: statistics.median(b[key] for b in later) for key in ("latency_s", "fit_s")}
    median["other_s"] = median["latency_s"] - median["fit_s"]
    print(
        f"first micro-batch: {batches[0]['latency_s']:.2f} s (fit {batches[0]['fit_s']:.2f} s); "
        f"later ones, median of {len(later)}: {median['latency_s']:.2f} s "
        f"(fit {median['fit_s']:.2f} s, the rest {median['other_s']:.2f} s)"
    )
    save_report(args.out, interval_s=args.interval, epochs=args.epochs, batches=batches, median=median)


if __name__ == "__main__":
    main()
