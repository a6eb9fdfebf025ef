"""A model, a pipeline and an estimator saved by sparkdl 0.1 (before the package layout by
layer) still load, and the model predicts what it predicted when it was saved.

The fixture (tests/fixtures/saved_by_0_1) was written by main at 173e505: its metadata
names the classes ``sparkdl.estimator.TorchModel`` and ``sparkdl.estimator.TorchEstimator``.
"""

import json
from pathlib import Path

import pytest

import sparkdl
from sparkdl import TorchEstimator, TorchModel
from tests.reference import make_tiny_net

pytestmark = pytest.mark.spark

SAVED = Path(__file__).resolve().parents[1] / "fixtures" / "saved_by_0_1"


def _dataframe(spark):
    rows = json.loads((SAVED / "predictions.json").read_text())
    return spark.createDataFrame([(r["features"],) for r in rows], "features array<float>"), rows


def _assert_same_predictions(model, spark):
    df, expected = _dataframe(spark)
    got = model.transform(df.coalesce(1)).orderBy("features").collect()
    assert [r.prediction for r in got] == [r["prediction"] for r in expected]
    for row, want in zip(got, expected, strict=True):
        assert list(row.probability) == pytest.approx(want["probability"], abs=1e-6)


def test_a_pipeline_saved_by_0_1_loads_and_predicts_as_it_did(spark):
    from pyspark.ml import PipelineModel

    metadata = next((SAVED / "pipeline/stages").glob("*/metadata/part-*")).read_text()
    assert '"class":"sparkdl.estimator.TorchModel"' in metadata  # the 0.1 class path
    with sparkdl.loading(model_fn=make_tiny_net):
        pipeline = PipelineModel.load(str(SAVED / "pipeline"))
    assert isinstance(pipeline.stages[0], TorchModel)
    _assert_same_predictions(pipeline, spark)


def test_a_model_saved_by_0_1_loads_with_its_history(spark):
    model = TorchModel.load(str(SAVED / "model"), model_fn=make_tiny_net)
    assert [h["epoch"] for h in model.history] == [1]
    assert model.getOrDefault("batch_size") == 8
    _assert_same_predictions(model, spark)


def test_an_estimator_saved_by_0_1_loads_with_its_settings(spark):
    estimator = TorchEstimator.load(str(SAVED / "estimator"), model_fn=make_tiny_net)
    assert estimator.model_fn is make_tiny_net
    assert (estimator.getOrDefault("epochs"), estimator.getOrDefault("num_workers")) == (1, 2)
    assert estimator.get_config().optimizer.lr == 0.1
