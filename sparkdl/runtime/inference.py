"""Batched inference on executors: the ``mapInArrow`` function behind ``transform``."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from sparkdl.config import UseGpu
from sparkdl.data.columns import ColumnPlan, decode_features
from sparkdl.errors import SchemaError
from sparkdl.runtime.device import choose_device
from sparkdl.training.factory import ModelFn, build_model, state_from_bytes


class OutputMode(str, enum.Enum):
    CLASS = "class"  # argmax of the outputs, as a double (classifiers)
    SCALAR = "scalar"  # the single output, as a double
    ARRAY = "array"  # all outputs, as array<float>


@dataclass(frozen=True)
class PredictSpec:
    model_fn: ModelFn
    state: bytes
    plan: ColumnPlan
    prediction_col: str
    mode: OutputMode
    batch_size: int
    use_gpu: UseGpu
    torch_threads: int


def output_mode(classifier: bool, output_shape: tuple[int, ...]) -> OutputMode:
    """Class index for classifiers; a double for one output; array<float> otherwise."""
    width = int(np.prod(output_shape)) if output_shape else 1
    if classifier and width > 1:
        return OutputMode.CLASS
    return OutputMode.SCALAR if width == 1 else OutputMode.ARRAY


def prediction_schema(schema: Any, column: str, mode: OutputMode) -> Any:
    """The input schema plus the prediction column."""
    from pyspark.sql.types import ArrayType, DoubleType, FloatType, StructField, StructType

    if column in schema.names:
        raise SchemaError(
            f"prediction column {column!r} already exists in the DataFrame; set prediction_col to a new name"
        )
    kind = ArrayType(FloatType(), containsNull=False) if mode is OutputMode.ARRAY else DoubleType()
    return StructType([*schema.fields, StructField(column, kind, nullable=False)])


def predict_partition(spec: PredictSpec, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Append the model's predictions to every record batch of a partition."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    resources = ctx.resources() if ctx else {}
    gpus = list(resources["gpu"].addresses) if "gpu" in resources else []
    device = choose_device(spec.use_gpu, gpus, torch.cuda.device_count(), ctx.partitionId() if ctx else 0)
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    module = _cached_module(spec, str(device))
    for batch in batches:
        yield batch.append_column(spec.prediction_col, predict_batch(module, batch, spec, device))


def predict_batch(
    module: torch.nn.Module, batch: pa.RecordBatch, spec: PredictSpec, device: torch.device
) -> pa.Array:
    """Run the model over one record batch in chunks of ``spec.batch_size`` rows."""
    if batch.num_rows == 0:
        return pa.array([], pa.float64() if spec.mode is not OutputMode.ARRAY else pa.list_(pa.float32()))
    features = decode_features(batch, spec.plan)
    if not features.flags.writeable:  # a zero-copy view of Arrow memory
        features = features.copy()
    outputs = []
    with torch.inference_mode():
        for start in range(0, len(features), spec.batch_size):
            x = torch.from_numpy(features[start : start + spec.batch_size]).to(device)
            out = module(x).float().reshape(len(x), -1)
            if spec.mode is OutputMode.CLASS:
                out = out.argmax(dim=1, keepdim=True).double()
            outputs.append(out.cpu().numpy())
    values = np.concatenate(outputs)
    if spec.mode is OutputMode.ARRAY:
        width = values.shape[1]
        offsets = pa.array(np.arange(0, (len(values) + 1) * width, width, dtype=np.int32))
        return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), pa.float32()))
    return pa.array(values[:, 0].astype(np.float64))


_MODULES: dict[tuple[str, str], torch.nn.Module] = {}


def _cached_module(spec: PredictSpec, device: str) -> torch.nn.Module:
    """One loaded model per Python worker and weights, reused across tasks."""
    key = (hashlib.sha256(spec.state).hexdigest(), device)
    if key not in _MODULES:
        if len(_MODULES) >= 4:
            _MODULES.clear()
        module = build_model(spec.model_fn)
        module.load_state_dict(state_from_bytes(spec.state))
        _MODULES[key] = module.to(device).eval()
    return _MODULES[key]
