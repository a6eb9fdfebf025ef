"""The columns transform adds (prediction, rawPrediction, probability), from known outputs, without Spark."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from sparkdl.config import UseGpu
from sparkdl.data.inputs import plan_data
from sparkdl.errors import SchemaError
from sparkdl.spark import inference
from sparkdl.spark.inference import (
    VECTOR_ARROW_TYPE,
    ModelWeights,
    OutputCols,
    OutputMode,
    PredictSpec,
    model_outputs,
    output_arrays,
    output_mode,
    prediction_schema,
)
from sparkdl.training.factory import state_to_bytes

ALL = OutputCols("prediction", "rawPrediction", "probability")


def vectors(array: pa.Array) -> list[list[float]]:
    """The Vectors of a column as Spark reads them (VectorUDT.deserialize of each struct)."""
    from pyspark.ml.linalg import DenseVector, VectorUDT

    udt = VectorUDT()
    out = [udt.deserialize(tuple(row.values())) for row in array.to_pylist()]
    assert all(isinstance(v, DenseVector) for v in out)
    return [v.toArray().tolist() for v in out]


def test_a_classifier_gets_argmax_raw_outputs_and_softmax():
    logits = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [5.0, -1.0, 2.0], [-3.0, 4.0, 4.0]], np.float32)
    out = output_arrays(logits, OutputMode.CLASS, ALL)
    assert list(out) == ["prediction", "rawPrediction", "probability"]
    assert out["prediction"].type == pa.float64()
    assert out["prediction"].to_pylist() == [2.0, 0.0, 0.0, 1.0]  # ties go to the first class
    assert vectors(out["rawPrediction"]) == logits.astype(np.float64).tolist()
    expected = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits.tolist()]
    np.testing.assert_allclose(vectors(out["probability"]), expected, rtol=1e-12)
    np.testing.assert_allclose(np.sum(vectors(out["probability"]), axis=1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(vectors(out["probability"])[1], [1 / 3] * 3, rtol=1e-12)


def test_one_logit_follows_sparks_binary_convention():
    z = np.array([[2.0], [-1.0], [0.0], [40.0], [-800.0]], np.float32)
    out = output_arrays(z, OutputMode.BINARY, ALL)
    assert out["prediction"].to_pylist() == [1.0, 0.0, 0.0, 1.0, 0.0]  # 1.0 only when the logit > 0
    assert vectors(out["rawPrediction"]) == [
        [-2.0, 2.0],
        [1.0, -1.0],
        [-0.0, 0.0],
        [-40.0, 40.0],
        [800.0, -800.0],
    ]
    sigmoid = [1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(1.0)), 0.5, 1 / (1 + math.exp(-40.0)), 0.0]
    probability = vectors(out["probability"])
    np.testing.assert_allclose([p[1] for p in probability], sigmoid, rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose([p[0] for p in probability], [1 - s for s in sigmoid], rtol=1e-12, atol=1e-17)
    assert probability[4] == [1.0, 0.0]  # no overflow for a large logit
    np.testing.assert_allclose(np.sum(probability, axis=1), 1.0, rtol=1e-15)


def test_vector_columns_have_the_arrow_type_spark_stores_vectors_as():
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.pandas.types import to_arrow_type

    assert to_arrow_type(VectorUDT()) == VECTOR_ARROW_TYPE
    out = output_arrays(np.zeros((3, 2), np.float32), OutputMode.CLASS, ALL)
    assert out["rawPrediction"].type == VECTOR_ARROW_TYPE and out["probability"].type == VECTOR_ARROW_TYPE
    assert out["rawPrediction"].field("type").to_pylist() == [1, 1, 1]  # dense
    assert out["rawPrediction"].field("size").null_count == 3
    assert out["rawPrediction"].field("indices").null_count == 3
    assert out["probability"].validate(full=True) is None


@pytest.mark.parametrize("mode", list(OutputMode))
def test_an_empty_batch_gives_empty_columns_of_the_same_types(mode):
    full = output_arrays(np.ones((2, 1 if mode is not OutputMode.CLASS else 3), np.float32), mode, ALL)
    empty = output_arrays(np.zeros((0, 1), np.float32), mode, ALL)
    assert list(empty) == list(full)
    assert [(len(a), a.type) for a in empty.values()] == [(0, a.type) for a in full.values()]


def test_a_column_named_empty_is_left_out():
    logits = np.array([[0.5, -0.5]], np.float32)
    only_probability = output_arrays(logits, OutputMode.CLASS, OutputCols("prediction", "", "probability"))
    assert list(only_probability) == ["prediction", "probability"]
    no_prediction = output_arrays(logits, OutputMode.CLASS, OutputCols("", "raw", ""))
    assert list(no_prediction) == ["raw"]
    assert vectors(no_prediction["raw"]) == [[0.5, -0.5]]


def test_a_regression_adds_only_the_prediction():
    scalar = output_arrays(np.array([[1.5], [-2.0]], np.float32), OutputMode.SCALAR, ALL)
    assert list(scalar) == ["prediction"] and scalar["prediction"].to_pylist() == [1.5, -2.0]
    assert scalar["prediction"].type == pa.float64()
    several = output_arrays(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), OutputMode.ARRAY, ALL)
    assert list(several) == ["prediction"] and several["prediction"].to_pylist() == [[1.0, 2.0], [3.0, 4.0]]
    assert several["prediction"].type.value_type == pa.float32()


def test_the_output_mode_follows_the_loss_and_the_width():
    assert output_mode(True, (3,)) is OutputMode.CLASS
    assert output_mode(False, (1,), binary=True) is OutputMode.BINARY
    assert output_mode(False, (4,), binary=True) is OutputMode.ARRAY  # multi-label: raw outputs
    assert output_mode(True, (1,)) is OutputMode.SCALAR
    assert output_mode(False, (1,)) is OutputMode.SCALAR
    assert output_mode(False, (2, 2)) is OutputMode.ARRAY


def test_the_schema_names_each_added_column_and_refuses_duplicates():
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.types import DoubleType, StructField, StructType

    schema = StructType([StructField("features", VectorUDT()), StructField("label", DoubleType())])
    out = prediction_schema(schema, ALL, OutputMode.BINARY)
    assert out.names == ["features", "label", "prediction", "rawPrediction", "probability"]
    assert [f.dataType for f in out.fields[2:]] == [DoubleType(), VectorUDT(), VectorUDT()]
    assert prediction_schema(schema, ALL, OutputMode.SCALAR).names[2:] == ["prediction"]
    assert prediction_schema(schema, OutputCols("p", "", ""), OutputMode.CLASS).names[2:] == ["p"]
    with pytest.raises(
        SchemaError, match=r"'label' .*\(probability_col\) already exists.*set probability_col"
    ):
        prediction_schema(schema, OutputCols("prediction", "rawPrediction", "label"), OutputMode.CLASS)
    with pytest.raises(SchemaError, match=r"'p' .*raw_prediction_col"):
        prediction_schema(schema, OutputCols("p", "p", ""), OutputMode.CLASS)
    with pytest.raises(SchemaError, match="set prediction_col"):
        prediction_schema(schema, OutputCols("features"), OutputMode.SCALAR)


def linear_spec(
    module: torch.nn.Module, batch: pa.RecordBatch, mode: OutputMode, batch_size: int
) -> PredictSpec:
    state = state_to_bytes(module)
    plan = plan_data(batch.schema, feature_cols=("features",))
    return PredictSpec(
        lambda: torch.nn.Linear(2, module.out_features),
        ModelWeights(hashlib.sha256(state).hexdigest(), data=state),
        plan,
        ALL,
        mode,
        batch_size,
        UseGpu.NO,
        1,
    )


def features_batch(x: np.ndarray) -> pa.RecordBatch:
    values = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1), pa.float32()), 2)
    return pa.RecordBatch.from_arrays([values.cast(pa.list_(pa.float32()))], ["features"])


@pytest.mark.parametrize("batch_size", [1, 2, 1024])
def test_the_model_outputs_of_a_record_batch_match_the_model_whatever_the_chunking(batch_size):
    module = torch.nn.Linear(2, 3)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        module.bias.copy_(torch.tensor([0.0, 0.5, -1.0]))
    x = np.array([[1.0, 2.0], [3.0, -1.0], [0.0, 0.0]], np.float32)
    batch = features_batch(x)
    spec = linear_spec(module, batch, OutputMode.CLASS, batch_size)
    outputs = model_outputs(module.eval(), batch, spec, torch.device("cpu"))
    np.testing.assert_allclose(outputs, [[1.0, 2.5, 2.0], [3.0, -0.5, 1.0], [0.0, 0.5, -1.0]], rtol=1e-6)
    assert output_arrays(outputs, spec.mode, ALL)["prediction"].to_pylist() == [1.0, 0.0, 1.0]
    empty = model_outputs(module, features_batch(np.zeros((0, 2), np.float32)), spec, torch.device("cpu"))
    assert empty.shape == (0, 1)


def test_one_loaded_model_per_worker_keyed_by_the_digest_computed_on_the_driver(monkeypatch):
    built = []

    def model_fn() -> torch.nn.Module:
        built.append(1)
        return torch.nn.Linear(2, 1)

    batch = features_batch(np.zeros((1, 2), np.float32))
    spec = linear_spec(torch.nn.Linear(2, 1), batch, OutputMode.BINARY, 8)
    spec = PredictSpec(model_fn, *list(spec.__dict__.values())[1:])
    monkeypatch.setattr(inference, "_MODULES", {})
    monkeypatch.setattr(hashlib, "sha256", lambda *_: pytest.fail("a task hashed the weights again"))
    first = inference._cached_module(spec, "cpu")
    assert inference._cached_module(spec, "cpu") is first
    assert built == [1] and not first.training
