"""A record batch decoded into a :class:`~sparkdl.data.blocks.Block`, as a :class:`DataPlan` says.

Every input by its own decoder (:mod:`sparkdl.data.columns`), or the user's
``transform_fn`` on the raw rows; the label and weight checked; non-finite values found
and named by column. Pure: pyarrow and numpy, no torch and no Spark.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from sparkdl.data.blocks import Block, Column, Ragged, values_of
from sparkdl.data.columns import (
    checked_label,
    checked_weight,
    decode_column,
    decode_label,
    decode_natural,
    decode_sequence,
    decode_weight,
    flat_rows,
    nonfinite_rows,
)
from sparkdl.data.inputs import DataPlan, InputKind, InputSpec
from sparkdl.errors import BadDataError, SchemaError


def decode_block(batch: pa.RecordBatch, plan: DataPlan, training: bool = True) -> Block:
    """A record batch as a block: every input, the label and the weight, checked.

    Raises:
        BadDataError: nulls, ragged arrays, NaN or infinite values, unusable labels;
            naming the column and counting the rows.
        SchemaError: transform_fn returned something that is not named arrays of one length.
    """
    inputs: dict[str, Column] = {spec.name: decode_input(batch, spec) for spec in plan.inputs}
    label = weight = None
    if plan.transform_fn is not None:
        produced = run_transform(plan, batch, training)
        for name in plan.not_inputs:  # the label of labelled rows at inference: never an input
            produced.pop(name, None)
        if plan.label is not None and plan.label.name in produced:
            label = checked_label(produced.pop(plan.label.name), plan.label.name, plan.label_kind)
        if plan.weight is not None and plan.weight.name in produced:
            weight = checked_weight(produced.pop(plan.weight.name), plan.weight.name)
        clash = sorted(set(produced) & (set(inputs) | plan.masks))
        if clash:
            raise SchemaError(f"transform_fn returned {clash}, which are also names in inputs; rename one")
        inputs.update(produced)
    if label is None and plan.label is not None:
        label = decode_label(batch, plan.label, plan.label_kind)
    if weight is None and plan.weight is not None:
        weight = decode_weight(batch, plan.weight)
    block = Block(inputs, label, weight)
    check_finite(block, plan)
    return block


def decode_input(batch: pa.RecordBatch, spec: InputSpec) -> Column:
    """One input of a record batch (not yet checked for NaN)."""
    if spec.kind is InputKind.MATRIX:
        parts = [decode_column(batch.column(c.name), c) for c in spec.columns]
        matrix = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        return np.ascontiguousarray(matrix, dtype=np.float32)
    column = spec.columns[0]
    if spec.text is not None:  # InputKind.TEXT: tokenized, one encode_batch per record batch
        return spec.text.encode(batch.column(column.name), column.name)
    if spec.kind is InputKind.SEQUENCE:
        return decode_sequence(batch.column(column.name), column)
    return decode_natural(batch.column(column.name), column, spec.shape)


def run_transform(plan: DataPlan, batch: pa.RecordBatch, training: bool) -> dict[str, np.ndarray]:
    """The user's transform_fn on one record batch, its output checked and typed:
    float64 becomes float32 and every integer type int64; other dtypes stay."""
    assert plan.transform_fn is not None
    out = plan.transform_fn(batch, training=training) if plan._takes_training else plan.transform_fn(batch)
    if not isinstance(out, Mapping):
        raise SchemaError(
            f"transform_fn returned a {type(out).__name__}; it must return a dict of "
            "input name -> array with one row per input row"
        )
    produced: dict[str, np.ndarray] = {}
    for name, value in out.items():
        array = (
            value.numpy()
            if hasattr(value, "numpy") and not isinstance(value, np.ndarray)
            else np.asarray(value)
        )
        if array.dtype == object or array.ndim == 0:
            raise SchemaError(
                f"transform_fn returned {name!r} as {array.dtype} with shape {array.shape}; return numeric "
                "arrays of shape (rows, ...) (pad sequences to one length per batch)"
            )
        if array.dtype == np.float64:
            array = array.astype(np.float32)
        elif array.dtype.kind in "iu" and array.dtype != np.uint8:
            array = array.astype(np.int64)
        produced[str(name)] = np.require(array, requirements=["C", "W"])
    lengths = {name: len(a) for name, a in produced.items()}
    expected = batch.num_rows
    wrong = {name: n for name, n in lengths.items() if n != expected}
    if wrong:
        raise SchemaError(
            f"transform_fn returned arrays of {wrong} rows for a batch of {expected} rows; every array "
            "must have one row per input row (drop rows before fit, not in transform_fn: the epoch "
            "plan counts the rows Spark delivers)"
        )
    return produced


def check_finite(block: Block, plan: DataPlan) -> None:
    """Raise a BadDataError naming the input and the count of rows with NaN or infinity."""
    for name, column in block.inputs.items():
        values = values_of(column)
        if values.dtype.kind != "f":
            continue
        if isinstance(column, Ragged):
            bad_values = ~np.isfinite(flat_rows(values)).all(axis=1)
            if not bad_values.any():
                continue
            count = int(column.rows_where(bad_values).sum())
        else:
            mask = nonfinite_rows(flat_rows(column))
            if mask is None:
                continue
            count = int(mask.sum())
        spec = next((s for s in plan.inputs if s.name == name), None)
        where = spec.described if spec else f"input {name!r} from transform_fn"
        if spec is not None and not plan.keyword:
            where = f"feature column(s) {[c.name for c in spec.columns]}"
        column_name = ",".join(c.name for c in spec.columns) if spec else name
        raise BadDataError(
            f"{where} holds NaN or infinite values in {count} of {len(block)} rows of this batch; "
            "clean or impute them before fit (or set on_bad_rows = 'skip')",
            column=column_name,
            bad_rows=count,
        )
