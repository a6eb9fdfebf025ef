"""pyspark.ml conventions on a real local[2] Spark: the stock evaluators on their defaults,
CrossValidator and TrainValidationSplit over estimator settings inside a Pipeline, and
transform of a streaming DataFrame."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import sparkdl
from sparkdl import TorchEstimator

pytestmark = pytest.mark.spark

TINY = dict(num_workers=2, epochs=2, seed=0, progress=False, collective_timeout_s=60.0)


def linear(inputs: int, outputs: int):
    return lambda: torch.nn.Linear(inputs, outputs)


def adam(params):
    return torch.optim.Adam(params, lr=0.1)


def table(spark, x: np.ndarray, label: np.ndarray, label_type: str = "double"):
    """Columns a, b, ... (doubles), the features as one array<float> column, and the label."""
    names = [chr(ord("a") + i) for i in range(x.shape[1])]
    cast = int if label_type == "long" else float
    rows = [(*map(float, row), [float(v) for v in row], cast(y)) for row, y in zip(x, label, strict=True)]
    schema = ", ".join(f"{n} double" for n in names) + f", features array<float>, label {label_type}"
    return spark.createDataFrame(rows, schema)


@pytest.fixture(scope="module")
def separable(spark):
    """Two classes split by x0 + x1 = 0, with a margin."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(96, 2))
    x = x[np.abs(x.sum(axis=1)) > 0.3][:64]
    return table(spark, x, (x.sum(axis=1) > 0).astype(float))


@pytest.fixture(scope="module")
def binary_model(separable):
    estimator = TorchEstimator(
        model_fn=linear(2, 1), optimizer_fn=adam, loss_fn="bce_with_logits", batch_size=8, **TINY
    )
    return estimator.fit(separable)


def test_a_one_logit_classifier_gives_sparks_binary_columns_and_a_high_auc(binary_model, separable):
    from pyspark.ml.evaluation import BinaryClassificationEvaluator
    from pyspark.ml.linalg import DenseVector, VectorUDT

    out = binary_model.transform(separable)
    assert out.schema["rawPrediction"].dataType == VectorUDT()
    assert out.schema["probability"].dataType == VectorUDT()
    assert BinaryClassificationEvaluator().evaluate(out) > 0.95  # areaUnderROC from rawPrediction
    rows = out.collect()
    with torch.no_grad():
        logits = binary_model.module(torch.tensor([r["features"] for r in rows])).double()[:, 0].tolist()
    for row, z in zip(rows, logits, strict=True):
        assert isinstance(row["rawPrediction"], DenseVector) and isinstance(row["probability"], DenseVector)
        assert row["rawPrediction"].toArray().tolist() == pytest.approx([-z, z], rel=1e-6)
        assert row["probability"][1] == pytest.approx(1 / (1 + math.exp(-z)), rel=1e-6)
        assert sum(row["probability"]) == pytest.approx(1.0, abs=1e-12)
        assert row["prediction"] == (1.0 if z > 0 else 0.0)
    accuracy = np.mean([r["prediction"] == r["label"] for r in rows])
    assert accuracy > 0.9


def test_cross_validation_over_learning_rates_in_a_pipeline_picks_and_refits_the_best(spark, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.feature import VectorAssembler
    from pyspark.ml.tuning import CrossValidator, CrossValidatorModel, ParamGridBuilder

    rng = np.random.default_rng(2)
    centers = np.array([[3.0, 0.0], [-3.0, 3.0], [-3.0, -3.0]])
    label = np.arange(72) % 3
    df = table(spark, centers[label] + rng.normal(scale=0.5, size=(72, 2)), label, "long")
    estimator = TorchEstimator(
        model_fn=linear(2, 3), loss_fn="cross_entropy", feature_cols=["vec"], batch_size=8, **TINY
    )
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=["a", "b"], outputCol="vec"), estimator])
    grid = ParamGridBuilder().addGrid(estimator.lr, [1e-5, 0.2]).build()
    evaluator = MulticlassClassificationEvaluator()  # f1 of prediction against label
    cv = CrossValidator(estimator=pipeline, estimatorParamMaps=grid, evaluator=evaluator, numFolds=2, seed=3)
    fitted = cv.fit(df)
    assert len(fitted.avgMetrics) == 2
    assert fitted.avgMetrics[1] > fitted.avgMetrics[0]  # lr 1e-5 barely moves the initial weights
    best = fitted.bestModel
    assert isinstance(best, PipelineModel)
    assert best.stages[-1].getOrDefault("lr") == 0.2
    assert evaluator.evaluate(best.transform(df)) > 0.9
    path = str(tmp_path / "cv")
    fitted.save(path)
    with sparkdl.loading(model_fn=best.stages[-1].model_fn):  # CrossValidatorModel.load takes none
        loaded = CrossValidatorModel.load(path)
    assert loaded.avgMetrics == fitted.avgMetrics
    before = best.transform(df).select("prediction").collect()
    assert loaded.bestModel.transform(df).select("prediction").collect() == before


def test_train_validation_split_with_the_regression_evaluator_prefers_the_rate_that_learns(spark):
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import ParamGridBuilder, TrainValidationSplit

    rng = np.random.default_rng(4)
    x = rng.normal(size=(80, 2))
    df = table(spark, x, 2.0 * x[:, 0] - x[:, 1] + 0.5)
    estimator = TorchEstimator(model_fn=linear(2, 1), loss_fn="mse", batch_size=8, **TINY)
    grid = ParamGridBuilder().addGrid(estimator.lr, [1e-5, 0.1]).build()
    split = TrainValidationSplit(
        estimator=estimator, estimatorParamMaps=grid, evaluator=RegressionEvaluator(), trainRatio=0.75, seed=5
    )
    fitted = split.fit(df)
    rmse = fitted.validationMetrics
    assert len(rmse) == 2 and rmse[1] < rmse[0]  # rmse: smaller is better
    assert fitted.bestModel.getOrDefault("lr") == 0.1
    spread = float(np.std(2.0 * x[:, 0] - x[:, 1]))
    assert RegressionEvaluator().evaluate(fitted.bestModel.transform(df)) < 0.5 * spread


def test_transform_of_a_streaming_dataframe_matches_the_batch_transform(
    spark, binary_model, separable, tmp_path
):
    source = str(tmp_path / "stream")
    separable.select("features", "label").write.parquet(source)
    stream = spark.readStream.schema("features array<float>, label double").parquet(source)
    query = (
        binary_model.transform(stream)
        .select("features", "prediction", "probability")
        .writeStream.format("memory")
        .queryName("sparkdl_stream_predictions")
        .start()
    )
    try:
        query.processAllAvailable()
        streamed = spark.table("sparkdl_stream_predictions").collect()
    finally:
        query.stop()
    batch = binary_model.transform(separable).select("features", "prediction", "probability").collect()
    assert len(streamed) == len(batch) == 64
    by_features = lambda rows: sorted((tuple(r[0]), r[1], tuple(r[2])) for r in rows)  # noqa: E731
    assert by_features(streamed) == by_features(batch)
