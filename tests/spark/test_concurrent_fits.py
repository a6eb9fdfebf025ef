"""Several fits at once from threads of one driver, on a real local[2] Spark: pyspark.ml's
tuning with ``parallelism`` > 1 (whose trial threads share one local-properties object),
two ``sparkdl.run`` calls, and a ``transform`` beside a ``fit``. Before, the trials' stages
ran in one trial's job group, so the other trial's ranks never learnt their stage attempt
and waited at the driver's store until ``collective_timeout_s``."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest
import torch

import sparkdl
from sparkdl import TorchEstimator
from tests.reference import make_shards, make_tiny_net, max_abs_diff, reference_sgd
from tests.spark.test_fit import shards_dataframe
from tests.spark.test_own_loop_spark import LR, MOMENTUM, resumable_loop

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def trial_estimator(workers: int, **settings: Any) -> TorchEstimator:
    base = dict(
        model_fn=make_tiny_net,
        loss_fn="cross_entropy",
        feature_cols=["features"],
        label_col="label",
        num_workers=workers,
        batch_size=8,
        epochs=2,
        seed=0,
        shuffle=False,
        progress=False,
        collective_timeout_s=30.0,  # a trial whose ranks cannot meet fails in 30 s, not a hang
    )
    return TorchEstimator(**{**base, **settings})


def test_the_trial_threads_of_pyspark_tuning_share_local_properties_but_not_a_fits_job_group(spark):
    """What CrossValidator does: one inheritable_thread_target(session) for every trial, so
    every trial thread holds the same properties object; inside own_local_properties a
    thread's job group is its own, and the shared one is as it was after."""
    from pyspark import inheritable_thread_target

    from sparkdl.spark.cluster import own_local_properties

    sc = spark.sparkContext
    both_set = threading.Barrier(2, timeout=30)
    seen: dict[str, Any] = {}

    def trial(name: str, own: bool) -> None:
        with own_local_properties(spark) if own else contextlib.nullcontext():
            sc.setLocalProperty("spark.jobGroup.id", name)
            both_set.wait()
            seen[name] = sc.getLocalProperty("spark.jobGroup.id")
            both_set.wait()
        seen[f"{name} after"] = sc.getLocalProperty("spark.jobGroup.id")

    for own in (False, True):
        seen.clear()
        wrap = inheritable_thread_target(spark)  # as CrossValidator.fit does, once for its trials
        threads = [threading.Thread(target=wrap(trial), args=(name, own)) for name in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        if own:
            assert (seen["a"], seen["b"]) == ("a", "b")
            assert seen["a after"] is None and seen["b after"] is None  # the shared object untouched
        else:  # the shared object: the last thread's group is everybody's
            assert seen["a"] == seen["b"]


def tuning_metrics(spark, tuner: type, workers: int, **settings: Any) -> dict[int, list[float]]:
    """``tuner`` (CrossValidator or TrainValidationSplit) over two learning rates of
    ``workers``-worker trials, fitted with parallelism 2 and then 1: each one's metrics."""
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    df = shards_dataframe(spark, make_shards([60, 60])).cache()
    estimator = trial_estimator(workers)
    grid = ParamGridBuilder().addGrid(estimator.lr, [0.05, 0.2]).build()
    metrics = {}
    for parallelism in (2, 1):
        fitted = tuner(
            estimator=estimator,
            estimatorParamMaps=grid,
            evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
            parallelism=parallelism,
            **settings,
        ).fit(df)
        metrics[parallelism] = fitted.avgMetrics if tuner is CrossValidator else fitted.validationMetrics
    df.unpersist()
    return metrics


def test_cross_validation_of_one_worker_trials_side_by_side_gives_the_sequential_metrics(spark):
    """The issue's run: 1-worker trials, parallelism = 2 on local[2] (before: it hung, then
    failed with 'the workers did not all meet at the driver's store')."""
    from pyspark.ml.tuning import CrossValidator

    metrics = tuning_metrics(spark, CrossValidator, 1, numFolds=2, seed=1)
    assert metrics[2] == metrics[1]  # the same seeds, the same models: the same figures


def test_two_worker_trials_on_two_slots_take_turns_and_give_the_sequential_metrics(spark):
    """Each trial needs both slots of local[2]: with parallelism = 2 one trial's barrier stage
    waits for the other's to end (no timeout counts that wait), then runs."""
    from pyspark.ml.tuning import TrainValidationSplit

    metrics = tuning_metrics(spark, TrainValidationSplit, 2, trainRatio=0.75, seed=2)
    assert metrics[2] == metrics[1]


def test_two_own_loops_from_two_threads_at_once_each_give_single_process_sgd(spark):
    shards = [make_shards([40], seed=s) for s in (7, 8)]
    results: dict[int, Any] = {}

    def run(index: int) -> None:
        try:
            results[index] = sparkdl.run(
                resumable_loop,
                df=shards_dataframe(spark, shards[index]),
                num_workers=1,
                batch_size=8,
                epochs=2,
                shuffle=False,
                progress=False,
                collective_timeout_s=30.0,
            )
        except Exception as exc:  # reported below
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    for index in (0, 1):
        assert not isinstance(results[index], Exception), results[index]
        expected = reference_sgd(shards[index], 8, 2, 0, LR, MOMENTUM, False)
        assert max_abs_diff(results[index].value, expected) < 1e-5


def slow_loss(output, target):
    """Cross entropy taking 20 ms a step more: a fit that is still training a second later."""
    time.sleep(0.02)
    return torch.nn.functional.cross_entropy(output, target.long())


def training_stage_runs(sc: Any) -> bool:
    """Whether a fit's barrier stage (a job of a sparkdl-fit- group) is running."""
    jobs = sc._jsc.sc().statusStore().jobsList(None)
    for index in range(jobs.size()):
        job = jobs.apply(index)
        group = job.jobGroup().getOrElse(None) if job.jobGroup().isDefined() else ""
        if str(job.status()) == "RUNNING" and str(group).startswith("sparkdl-fit-"):
            return True
    return False


def test_a_transform_while_a_fit_runs_gives_what_it_gives_alone(spark):
    df = shards_dataframe(spark, make_shards([80, 80]))
    model = trial_estimator(1).fit(df)
    alone = model.transform(df).select("prediction").collect()
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["fit"] = trial_estimator(1, epochs=6, loss_fn=slow_loss).fit(df)
        except Exception as exc:  # reported below
            outcome["fit"] = exc

    thread = threading.Thread(target=fit)
    thread.start()
    deadline = time.monotonic() + 120
    while not training_stage_runs(spark.sparkContext) and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert thread.is_alive(), outcome  # the fit trains while the transform runs
    beside = model.transform(df).select("prediction").collect()
    thread.join(300)
    assert not isinstance(outcome["fit"], Exception), outcome["fit"]
    assert beside == alone
    assert len(outcome["fit"].history) == 6


def test_a_transform_with_params_is_served_while_its_model_lives_whatever_is_offered_meanwhile(spark):
    """pyspark.ml's tuning evaluates ``model.transform(validation, params)``, lazy, while the
    other trials offer their models: the copy that transform made is gone by then, and its
    offer was pruned after KEEP_RELEASED newer ones (WeightTransferError: 'the driver no
    longer serves the weights of this model'). The offer now lives as long as the module the
    model and its copies share."""
    import gc

    from sparkdl.services.weights.server import KEEP_RELEASED

    df = shards_dataframe(spark, make_shards([12, 12]))
    model = trial_estimator(1, epochs=1).fit(df)
    expected = [row[0] for row in model.transform(df).select("prediction").collect()]
    lazy = model.transform(df, {model.getParam("prediction_col"): "guess"})  # made by a copy
    gc.collect()  # the copy is gone
    for _ in range(KEEP_RELEASED + 2):  # as many other trials offering their models
        other = model.copy()
        other.module = make_tiny_net()
        other.transform(df).count()
        del other
        gc.collect()
    assert [row[0] for row in lazy.select("guess").collect()] == expected
