"""Trials side by side: pyspark.ml's TrainValidationSplit over 4 learning rates, 1-worker
trials, with parallelism = 4 against parallelism = 1, on one local[4] session.

    .venv/bin/python benchmarks/bench_tuning.py [--rows 20000] [--epochs 3] [--repeats 2]

After an untimed warm-up (the executors' Python workers start), each repeat fits both ways,
alternating which goes first; the wall time of ``fit`` (4 trials
and the refit of the best) and the validation metrics of each (which must be equal: the same
seeds). Results: benchmarks/results/tuning.json. The speed-up is bounded by the cores the
trials' workers get (local[4] on a 2-core machine: at most 2x).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import spark_setup  # noqa: E402,F401  (environment for the executors)
from common import make_model, make_table, save_report  # noqa: E402

from sparkdl import TorchEstimator  # noqa: E402
from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402

LRS = [0.01, 0.03, 0.1, 0.3]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--output", default=str(HERE / "results/tuning.json"))
    args = parser.parse_args()

    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import ParamGridBuilder, TrainValidationSplit

    spark = build_session("local[4]", "bench-tuning", SparkDLConfig(), {"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    spark.sparkContext.addPyFile(str(HERE / "common.py"))
    df = spark.createDataFrame(make_table(args.rows)).repartition(4).cache()
    df.count()
    estimator = TorchEstimator(
        model_fn=make_model, loss_fn="cross_entropy", feature_cols=["features"], label_col="label",
        num_workers=1, batch_size=128, epochs=args.epochs, seed=0, progress=False,
    )  # fmt: skip
    grid = ParamGridBuilder().addGrid(estimator.lr, LRS).build()
    seconds: dict[int, list[float]] = {1: [], 4: []}
    metrics: dict[int, list[float]] = {}
    # untimed: the first trials start the executors' Python workers (four at once)
    TrainValidationSplit(
        estimator=estimator, estimatorParamMaps=grid, trainRatio=0.8, parallelism=4, seed=3,
        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
    ).fit(df)  # fmt: skip
    for repeat in range(args.repeats):
        for parallelism in (4, 1) if repeat % 2 == 0 else (1, 4):
            split = TrainValidationSplit(
                estimator=estimator, estimatorParamMaps=grid, trainRatio=0.8, parallelism=parallelism, seed=3,
                evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
            )  # fmt: skip
            started = time.perf_counter()
            fitted = split.fit(df)
            seconds[parallelism].append(round(time.perf_counter() - started, 2))
            metrics[parallelism] = [round(m, 6) for m in fitted.validationMetrics]
            print(
                f"parallelism {parallelism}: {seconds[parallelism][-1]} s", metrics[parallelism], flush=True
            )
    sequential, parallel = statistics.median(seconds[1]), statistics.median(seconds[4])
    save_report(
        args.output,
        tuning={
            "rows": args.rows,
            "epochs": args.epochs,
            "trials": len(LRS),
            "seconds": {str(k): v for k, v in seconds.items()},
            "median_s": {"1": sequential, "4": parallel},
            "speedup": round(sequential / parallel, 2),
            "same_metrics": metrics[1] == metrics[4],
            "metrics": {str(k): v for k, v in metrics.items()},
        },
    )
    spark.stop()


if __name__ == "__main__":
    main()
