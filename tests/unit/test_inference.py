"""Batched prediction on one record batch, without Spark."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from sparkdl.config import UseGpu
from sparkdl.data.inputs import plan_data
from sparkdl.spark.inference import (
    ModelWeights,
    OutputCols,
    OutputMode,
    PredictSpec,
    model_outputs,
    output_arrays,
    output_mode,
)
from sparkdl.training.factory import state_to_bytes
from tests.reference import make_tiny_net, shard_to_batch


def spec_for(batch: pa.RecordBatch, mode: OutputMode, batch_size: int) -> PredictSpec:
    plan = plan_data(batch.schema, feature_cols=("features",))
    return PredictSpec(make_tiny_net, ModelWeights(""), plan, OutputCols(), mode, batch_size, UseGpu.NO, 1)


def predict_batch(module, batch, spec, device) -> pa.Array:
    """The prediction column transform appends to ``batch``."""
    return output_arrays(model_outputs(module, batch, spec, device), spec.mode, spec.columns)["prediction"]


@pytest.mark.parametrize("batch_size", [1, 4, 1024])
@pytest.mark.parametrize("mode", [m for m in OutputMode if m is not OutputMode.SEQUENCE])  # its own file
def test_predictions_match_the_model_on_the_whole_batch_whatever_the_chunking(mode, batch_size):
    x = np.random.default_rng(0).normal(size=(10, 6)).astype(np.float32)
    batch = shard_to_batch(x, np.zeros(10, dtype=np.int64))
    module = make_tiny_net().eval()
    with torch.no_grad():
        expected = module(torch.from_numpy(x))
    if mode in (OutputMode.SCALAR, OutputMode.BINARY):
        module = torch.nn.Sequential(module, torch.nn.Linear(3, 1)).eval()
        with torch.no_grad():
            expected = module(torch.from_numpy(x))
    out = predict_batch(module, batch, spec_for(batch, mode, batch_size), torch.device("cpu"))
    assert len(out) == 10
    if mode is OutputMode.CLASS:
        assert out.to_pylist() == expected.argmax(1).double().tolist()
    elif mode is OutputMode.BINARY:
        assert out.to_pylist() == (expected[:, 0] > 0).double().tolist()
    elif mode is OutputMode.SCALAR:
        np.testing.assert_allclose(out.to_numpy(), expected[:, 0].numpy(), rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_allclose(np.array(out.to_pylist()), expected.numpy(), rtol=1e-5, atol=1e-6)


def test_an_empty_batch_gives_an_empty_column_of_the_right_type():
    batch = shard_to_batch(np.zeros((0, 6), np.float32), np.zeros(0, np.int64))
    for mode, typ in [(OutputMode.CLASS, pa.float64()), (OutputMode.ARRAY, pa.list_(pa.float32()))]:
        out = predict_batch(make_tiny_net(), batch, spec_for(batch, mode, 8), torch.device("cpu"))
        assert len(out) == 0 and out.type == typ


def test_the_output_mode_follows_the_model_and_the_loss():
    assert output_mode(True, (3,)) is OutputMode.CLASS
    assert output_mode(True, (1,)) is OutputMode.SCALAR
    assert output_mode(False, (1,)) is OutputMode.SCALAR
    assert output_mode(False, (4,)) is OutputMode.ARRAY
    assert state_to_bytes(make_tiny_net())  # the weights a PredictSpec carries are plain bytes
