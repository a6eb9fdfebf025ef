"""The first fit in a fresh session against the later ones, and where the first one's time goes.

    .venv/bin/python benchmarks/bench_first_fit.py [--sessions 3] [--fits 3]

Each session is a fresh Python process (a new driver, JVM and executors, as a new job or
notebook is): it builds a ``local[2]`` session, then runs
``--fits`` small fits (2,000 rows, 2 workers, 1 epoch, the benchmark MLP). Recorded per fit:
its wall time. Four variants, interleaved: ``plain`` (``SparkSession.builder`` with
``PYSPARK_PYTHON`` set, as a notebook's ``spark`` or spark-submit's session),
``sparkdl`` (``sparkdl.session``: workers forked from sparkdl's daemon with torch
imported, and the background warm-up where the machine has cores to spare),
``no_warm_up`` (the same session without the warm-up) and ``pyspark_daemon`` (with the
warm-up, but PySpark's own worker daemon). ``to_first_model_s`` adds the session and data
preparation, which the warm-up overlaps with.
Results: benchmarks/results/first_fit.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import save_report  # noqa: E402

_SESSION = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
started = time.perf_counter()
import sparkdl
from benchmarks.common import make_data, make_model, make_optimizer
from sparkdl.config import SparkDLConfig
from sparkdl.spark.session import build_session
variant = {variant!r}
extra = {{"spark.python.daemon.module": "pyspark.daemon"}} if variant == "pyspark_daemon" else {{}}
conf = {{"spark.ui.enabled": "false", **extra}}
if variant == "plain":  # what a notebook's `spark` or spark-submit's session is
    from pyspark.sql import SparkSession
    spark = SparkSession.builder.master("local[2]").appName("sparkdl-first-fit").config(
        "spark.ui.enabled", "false").getOrCreate()
elif variant == "no_warm_up":  # what sparkdl.session does, less the warm-up
    spark = build_session("local[2]", "sparkdl-first-fit", SparkDLConfig(), conf)
else:
    spark = sparkdl.session("local[2]", "sparkdl-first-fit", **conf)
spark.sparkContext.setLogLevel("ERROR")
spark.sparkContext.addPyFile(os.path.join({root!r}, "benchmarks", "common.py"))
import pyarrow as pa
x, y = make_data(2000)
table = pa.table({{"features": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])
                  .cast(pa.list_(pa.float32())), "label": pa.array(y)}})
df = spark.createDataFrame(table).repartition(2).cache()
counted = time.perf_counter()
df.count()  # the user's own first Spark action
count_s = time.perf_counter() - counted
session_s = time.perf_counter() - started
fits = []
for _ in range({fits}):
    estimator = sparkdl.TorchEstimator(
        model_fn=make_model, optimizer_fn=make_optimizer, loss_fn="cross_entropy",
        num_workers=2, batch_size=128, epochs=1, progress=False, torch_threads=1,
    )
    t = time.perf_counter()
    model = estimator.fit(df)
    fits.append({{"seconds": time.perf_counter() - t, "training_s": model.history[-1]["seconds"]}})
print(json.dumps({{"session_s": session_s, "count_s": count_s, "fits": fits}}))
spark.stop()
"""


def one_session(fits: int, variant: str) -> dict[str, Any]:
    code = _SESSION.format(root=str(ROOT), fits=fits, variant=variant)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--fits", type=int, default=3)
    parser.add_argument("--variants", default="plain,sparkdl,no_warm_up,pyspark_daemon")
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/first_fit.json"))
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants.split(",")}
    for _ in range(args.sessions):  # interleaved
        for variant in results:
            results[variant].append(one_session(args.fits, variant))
            print(variant, results[variant][-1], flush=True)
    summary = {}
    for variant, sessions in results.items():
        first = statistics.median(s["fits"][0]["seconds"] for s in sessions)
        later = statistics.median(f["seconds"] for s in sessions for f in s["fits"][1:])
        start = statistics.median(s["session_s"] for s in sessions)
        count = statistics.median(s["count_s"] for s in sessions)
        summary[variant] = {
            "first_fit_s": round(first, 2),
            "later_fit_s": round(later, 2),
            "first_over_later": round(first / later, 2),
            "session_and_data_s": round(start, 2),
            "first_count_s": round(count, 2),
            "to_first_model_s": round(start + first, 2),
        }
    save_report(args.output, summary=summary, sessions=results)


if __name__ == "__main__":
    main()
