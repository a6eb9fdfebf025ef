"""L-BFGS (optimizer = "lbfgs") against Spark's own LogisticRegression, and against sparkdl's
step-wise optimizers, on one regularized softmax regression (issue 34 item 1).

The data: scikit-learn's digits (1,797 rows, 64 pixels, 10 classes), standardized, repeated
``--copies`` times with Gaussian noise; a held-out noisy copy measures accuracy. The
problem: mean cross-entropy + reg / 2 * |W|^2, no intercept (Spark's regParam with
elasticNetParam = 0, standardization off, fitIntercept off: the same objective). Each run's
objective is computed afterwards in float64 on every training row, so all are compared on
one yardstick. Passes: sparkdl's history counts them; Spark's are its jobs (one
treeAggregate per evaluation of the objective).

    .venv/bin/python benchmarks/bench_lbfgs.py [--copies 20] [--reg 1e-3]

``--advise``: the advisor's predicted pass (``sparkdl.advise`` on an L-BFGS estimator) against
the passes of fits with the vectors on the workers and on the parameter server's shards, for
the softmax regression above and a wide MLP (64-2048-2048-10, 4.3M parameters) on a few rows,
whose gradient's exchange is a large part of its pass (run it under slow-net to see it):

    ../shared/tools/slow-net --rate 1gbit -- .venv/bin/python benchmarks/bench_lbfgs.py --advise
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # spark_setup sets the environment and puts sparkdl on the path

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import save_report  # noqa: E402
from spark_setup import bench_session  # noqa: E402
from torch import nn  # noqa: E402

from sparkdl import TorchEstimator  # noqa: E402

FEATURES, CLASSES = 64, 10


def digits(copies: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Digits standardized, repeated ``copies`` times with N(0, 0.5) noise added."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    std = x.std(0)
    x = (x - x.mean(0)) / np.where(std > 0, std, 1.0)
    rng = np.random.default_rng(seed)
    xs = np.concatenate([x + rng.normal(scale=0.5, size=x.shape) for _ in range(copies)])
    return xs.astype(np.float32), np.tile(y, copies).astype(np.int64)


def softmax_regression() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(FEATURES, CLASSES, bias=False)


def objective(weight: np.ndarray, x: np.ndarray, y: np.ndarray, reg: float) -> float:
    """mean cross-entropy + reg / 2 * |W|^2, in float64 on every row."""
    w = torch.from_numpy(weight.astype(np.float64))
    logits = torch.from_numpy(x.astype(np.float64)) @ w.T
    loss = nn.functional.cross_entropy(logits, torch.from_numpy(y))
    return float(loss + reg / 2 * w.square().sum())


def accuracy(weight: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    return float(((x @ weight.T).argmax(1) == y).mean())


def jobs_in(spark, group: str) -> int:
    return len(spark.sparkContext.statusTracker().getJobIdsForGroup(group))


def wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 2048), nn.Tanh(), nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, CLASSES)
    )


def measured_pass_s(history: list[dict]) -> float:
    """The median seconds of a pass over the iterations after the first (whose first pass
    streams from Spark): an iteration's seconds over its evaluations."""
    per_pass = sorted(h["seconds"] / h["evaluations"] for h in history[1:])
    return per_pass[len(per_pass) // 2]


def advise_against_fits(args: argparse.Namespace) -> None:
    """Each workload: the advice's predicted pass per layout, then a fit in each layout (after
    an untimed first fit that starts the workers), and the ratio predicted / measured."""
    from sparkdl import advise

    spark = bench_session("bench_lbfgs_advise")
    results = {}
    workloads = {
        # the real problem: 35,940 rows, 640 parameters (the exchange is nothing)
        "softmax regression": (softmax_regression, digits(args.copies, seed=0), 8192),
        # 4.3M parameters (17.3 MB) on 800 rows: the exchange is a large part of a pass
        "wide MLP": (wide_mlp, digits(1, seed=0), 100),
    }
    for name, (model_fn, (x, y), batch) in workloads.items():
        if name == "wide MLP":
            x, y = x[:800], y[:800]
        rows = [(row.tolist(), int(label)) for row, label in zip(x, y, strict=True)]
        df = spark.createDataFrame(rows, "features array<float>, label long").repartition(2).cache()
        df.count()
        base = dict(
            model_fn=model_fn, feature_cols=["features"], num_workers=2, seed=0, optimizer="lbfgs", lr=1.0,
            weight_decay=args.reg, batch_size=batch, collective_timeout_s=120.0, progress=False,
            tolerance_grad=0.0, tolerance_change=0.0,
        )  # fmt: skip
        TorchEstimator(**base, max_iterations=2).fit(df)  # the workers' start: not timed
        advice = advise(df, TorchEstimator(**base), steps=4, budget_s=0.5)
        print(advice, flush=True)
        entry = {"advice": advice.to_dict(), "layouts": {}}
        for row in advice.rows:
            strategy = row.settings["strategy"]
            model = TorchEstimator(**base, strategy=strategy, max_iterations=args.advise_iterations).fit(df)
            pass_s = measured_pass_s(model.history)
            entry["layouts"][row.name] = {
                "predicted_pass_s": row.epoch_s,
                "measured_pass_s": pass_s,
                "predicted_over_measured": row.epoch_s / pass_s,
                "iterations": len(model.history),
                "passes": model.history[-1]["passes"],
            }
            print(name, row.name, entry["layouts"][row.name], flush=True)
        entry["recommended"] = advice.recommended.name
        entry["measured_faster"] = min(entry["layouts"], key=lambda k: entry["layouts"][k]["measured_pass_s"])
        results[name] = entry
    save_report(args.out, results=results)
    spark.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--advise", action="store_true", help="the advisor's pass against fits' (see above)")
    parser.add_argument("--advise-iterations", type=int, default=12)
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--reg", type=float, default=1e-3)
    parser.add_argument("--max-iterations", type=int, default=200)
    parser.add_argument("--step-epochs", default="20,60,180", help="epochs of each step-wise run")
    parser.add_argument("--out", default=str(HERE / "results" / "lbfgs.json"))
    args = parser.parse_args()
    if args.advise:
        if args.out == str(HERE / "results" / "lbfgs.json"):
            args.out = str(HERE / "results" / "lbfgs_advise.json")
        advise_against_fits(args)
        return
    x, y = digits(args.copies, seed=0)
    x_test, y_test = digits(1, seed=1)
    spark = bench_session("bench_lbfgs")
    from pyspark.ml.classification import LogisticRegression
    from pyspark.ml.functions import array_to_vector

    rows = [(row.tolist(), int(label)) for row, label in zip(x, y, strict=True)]
    df = spark.createDataFrame(rows, "features array<float>, label long").repartition(2).cache()
    df.count()
    vectors = df.select(array_to_vector("features").alias("features"), "label").cache()
    vectors.count()

    results = {}

    def record(name: str, weight: np.ndarray, seconds: float, passes: int, **extra) -> None:
        results[name] = {
            "objective": objective(weight, x, y, args.reg),
            "train_accuracy": accuracy(weight, x, y),
            "test_accuracy": accuracy(weight, x_test, y_test),
            "seconds": seconds,
            "passes": passes,
            **extra,
        }
        print(name, results[name], flush=True)

    # Spark's LogisticRegression (breeze L-BFGS in the JVM), converged hard, after a warm-up fit
    lr = LogisticRegression(
        maxIter=args.max_iterations,
        regParam=args.reg,
        elasticNetParam=0.0,
        family="multinomial",
        standardization=False,
        fitIntercept=False,
        tol=1e-12,
    )
    LogisticRegression(maxIter=2, regParam=args.reg, family="multinomial").fit(vectors)  # JVM warm-up
    spark.sparkContext.setJobGroup("spark_lr", "spark lr")
    started = time.perf_counter()
    fitted = lr.fit(vectors)
    seconds = time.perf_counter() - started
    weight = fitted.coefficientMatrix.toArray()
    record("spark LogisticRegression", weight, seconds, jobs_in(spark, "spark_lr"),
           iterations=fitted.summary.totalIterations)  # fmt: skip

    base = dict(
        model_fn=softmax_regression,
        feature_cols=["features"],
        num_workers=2,
        seed=0,
        weight_decay=args.reg,
        collective_timeout_s=120.0,
        progress=False,
    )
    # a first fit pays for the workers' start (torch imported, groups formed): not timed
    TorchEstimator(**base, optimizer="lbfgs", lr=1.0, batch_size=8192, max_iterations=2).fit(df)
    lbfgs_history = []
    for name, strategy in [
        ("sparkdl lbfgs", "allreduce"),
        ("sparkdl lbfgs, parameter server", "parameter_server"),
    ]:
        estimator = TorchEstimator(
            **base, optimizer="lbfgs", lr=1.0, batch_size=8192, max_iterations=args.max_iterations,
            tolerance_grad=1e-7, tolerance_change=1e-12, strategy=strategy,
        )  # fmt: skip
        started = time.perf_counter()
        model = estimator.fit(df)
        seconds = time.perf_counter() - started
        last = model.history[-1]
        weight = model.module.weight.detach().numpy()
        lbfgs_history = lbfgs_history or [(h["passes"], h["loss"]) for h in model.history]
        record(name, weight, seconds, last["passes"], iterations=last["iteration"], stopped=last["stopped"])

    for name, settings in [
        ("sparkdl adam", {"optimizer": "adam", "lr": 0.01}),
        ("sparkdl sgd momentum 0.9", {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}),
    ]:
        for epochs in [int(e) for e in args.step_epochs.split(",")]:
            estimator = TorchEstimator(**base, **settings, batch_size=256, epochs=epochs)
            started = time.perf_counter()
            model = estimator.fit(df)
            seconds = time.perf_counter() - started
            weight = model.module.weight.detach().numpy()
            record(f"{name}, {epochs} epochs", weight, seconds, epochs)

    best = results["spark LogisticRegression"]["objective"]
    for entry in results.values():
        entry["objective_gap"] = entry["objective"] - best
    # passes L-BFGS took to come within each gap of Spark's optimum (its history's objective)
    reached = {
        f"{gap:g}": next((passes for passes, loss in lbfgs_history if loss - best < gap), None)
        for gap in (1e-2, 1e-3, 1e-4, 1e-5, 1e-6)
    }
    results["sparkdl lbfgs"]["passes_to_gap"] = reached
    save_report(args.out, rows=len(y), features=FEATURES, classes=CLASSES, reg=args.reg, results=results)
    spark.stop()


if __name__ == "__main__":
    main()
