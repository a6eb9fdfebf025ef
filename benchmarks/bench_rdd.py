"""fit(rdd) against fit(DataFrame) on the same rows: rows per second of the whole fit.

    .venv/bin/python benchmarks/bench_rdd.py [--rows 200000] [--repeats 3]

The RDD holds (numpy float32 array, int) tuples, as a user's RDD of records would; the
DataFrame the same rows as array<float> and long columns. Both are cached, have two
partitions, and train the benchmark MLP for one epoch; the fits are interleaved and the
ratio is of medians. Results: benchmarks/results/rdd.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from benchmarks.common import make_data, make_model, make_optimizer, save_report  # noqa: E402
from benchmarks.spark_setup import bench_session, dataframe  # noqa: E402
from sparkdl import TorchEstimator  # noqa: E402


def estimator() -> TorchEstimator:
    return TorchEstimator(
        model_fn=make_model,
        optimizer_fn=make_optimizer,
        loss_fn="cross_entropy",
        num_workers=2,
        batch_size=128,
        epochs=1,
        progress=False,
        torch_threads=1,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    spark = bench_session("sparkdl-bench-rdd")
    df = dataframe(spark, args.rows, 2)
    x, y = make_data(args.rows)
    halves = [(x[i::2], y[i::2]) for i in range(2)]
    rdd = (
        spark.sparkContext.parallelize(range(2), 2)
        .flatMap(lambda i: [(halves[i][0][j], int(halves[i][1][j])) for j in range(len(halves[i][1]))])
        .cache()
    )
    rdd.count()
    seconds: dict[str, list[float]] = {"dataframe": [], "rdd": []}
    for _ in range(args.repeats):
        for name, data in (("dataframe", df), ("rdd", rdd)):
            started = time.perf_counter()
            estimator().fit(data)
            seconds[name].append(time.perf_counter() - started)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    rows_per_s = {name: args.rows / value for name, value in median.items()}
    report = save_report(
        str(ROOT / "benchmarks/results/rdd.json"),
        rows=args.rows,
        seconds=seconds,
        rows_per_s=rows_per_s,
        rdd_vs_dataframe=rows_per_s["rdd"] / rows_per_s["dataframe"],
    )
    print(report)
    spark.stop()


if __name__ == "__main__":
    main()
