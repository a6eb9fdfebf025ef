"""Arrow record batch -> numpy arrays, column by column, straight from Arrow buffers.

Pure: depends on pyarrow and numpy only. No pandas, no per-row Python. Every
check names the column and counts the bad rows, and nothing is silently coerced
(a null, a ragged array or a NaN is an error, never a zero).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkdl.errors import BadDataError, SchemaError


class ColumnKind(str, enum.Enum):
    """How one column turns into feature or label values."""

    SCALAR = "scalar"  # a numeric column: one value per row
    ARRAY = "array"  # array<numeric>: fixed length per row
    VECTOR = "vector"  # pyspark.ml Vector (dense or sparse), as its Arrow struct


class LabelKind(str, enum.Enum):
    """What the loss expects the label to be."""

    CLASS_INDEX = "class_index"  # int64 class ids (cross entropy)
    REAL = "real"  # float32 targets (mse, bce_with_logits, custom losses)


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    kind: ColumnKind


@dataclass(frozen=True)
class ColumnPlan:
    """Which columns are features and label, and how to decode each."""

    features: tuple[ColumnSpec, ...]
    label: ColumnSpec | None
    label_kind: LabelKind = LabelKind.REAL

    @property
    def column_names(self) -> list[str]:
        names = [c.name for c in self.features]
        return names + ([self.label.name] if self.label else [])


def kind_of_arrow_type(name: str, typ: pa.DataType) -> ColumnKind:
    """Classify an Arrow type, or raise a SchemaError saying which types are accepted."""
    if _is_numeric(typ):
        return ColumnKind.SCALAR
    if (pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)) and (
        _is_numeric(typ.value_type)
    ):
        return ColumnKind.ARRAY
    if pa.types.is_struct(typ) and {typ.field(i).name for i in range(typ.num_fields)} >= {
        "type",
        "values",
        "indices",
        "size",
    }:
        return ColumnKind.VECTOR
    raise SchemaError(
        f"column {name!r} has type {typ}, which cannot feed a model; use a numeric column, "
        "an array of numbers, or a pyspark.ml Vector (e.g. from VectorAssembler)"
    )


def plan_from_arrow_schema(
    schema: pa.Schema, feature_cols: tuple[str, ...], label_col: str | None, label_kind: LabelKind
) -> ColumnPlan:
    """Check that the columns exist and have usable types; return how to decode them."""
    missing = [c for c in (*feature_cols, *([label_col] if label_col else [])) if c not in schema.names]
    if missing:
        raise SchemaError(
            f"column(s) {missing} not found; the DataFrame has {schema.names}. "
            "Set feature_cols/label_col to existing columns"
        )
    features = tuple(ColumnSpec(c, kind_of_arrow_type(c, schema.field(c).type)) for c in feature_cols)
    label = None
    if label_col:
        kind = kind_of_arrow_type(label_col, schema.field(label_col).type)
        if kind is ColumnKind.VECTOR or (kind is ColumnKind.ARRAY and label_kind is LabelKind.CLASS_INDEX):
            raise SchemaError(
                f"label column {label_col!r} has type {schema.field(label_col).type}; "
                f"a {label_kind.value} label must be a numeric column"
            )
        label = ColumnSpec(label_col, kind)
    return ColumnPlan(features, label, label_kind)


def decode_features(batch: pa.RecordBatch, plan: ColumnPlan) -> np.ndarray:
    """Concatenate the feature columns of a batch into one float32 matrix [rows, width]."""
    matrix = feature_matrix(batch, plan)
    bad = nonfinite_rows(matrix)
    if bad is not None:
        names = [s.name for s in plan.features]
        raise BadDataError(
            f"feature column(s) {names} hold NaN or infinite values in {int(bad.sum())} of "
            f"{batch.num_rows} rows of this batch; clean or impute them before fit "
            "(or set on_bad_rows = 'skip')",
            column=",".join(names),
            bad_rows=int(bad.sum()),
        )
    return matrix


def feature_matrix(batch: pa.RecordBatch, plan: ColumnPlan) -> np.ndarray:
    """The features as float32 [rows, width], without the NaN check."""
    parts = [decode_column(batch.column(spec.name), spec) for spec in plan.features]
    matrix = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    return np.ascontiguousarray(matrix, dtype=np.float32)


def nonfinite_rows(matrix: np.ndarray) -> np.ndarray | None:
    """Mask of rows holding NaN or inf, or None when there are none."""
    # One cheap pass: a NaN or inf anywhere in a row makes its float64 sum non-finite
    # (float32 values cannot overflow a float64 sum); only then find the bad rows.
    if not matrix.size or np.isfinite(matrix.sum(axis=1, dtype=np.float64)).all():
        return None
    return ~np.isfinite(matrix.reshape(len(matrix), -1)).all(axis=1)


def decode_label(batch: pa.RecordBatch, plan: ColumnPlan) -> np.ndarray:
    """The label column as int64 class ids or float32 targets."""
    values = label_values(batch, plan)
    bad = bad_label_rows(values, plan.label_kind)
    name = plan.label.name if plan.label else ""
    if bad is not None and plan.label_kind is LabelKind.REAL:
        raise BadDataError(
            f"label column {name!r} holds NaN or infinite values in {int(bad.sum())} rows",
            column=name,
            bad_rows=int(bad.sum()),
        )
    if bad is not None:
        raise BadDataError(
            f"label column {name!r} must hold class indices 0..C-1 for cross entropy, "
            f"but {int(bad.sum())} rows hold negative or non-integer values "
            f"(e.g. {values[bad][0]!r}); index the labels (StringIndexer) first",
            column=name,
            bad_rows=int(bad.sum()),
        )
    return as_label(values, plan.label_kind)


def label_values(batch: pa.RecordBatch, plan: ColumnPlan) -> np.ndarray:
    """The raw label values ([rows] for a scalar label), before any check."""
    if plan.label is None:
        raise SchemaError("no label column was configured; set label_col")
    values = decode_column(batch.column(plan.label.name), plan.label)
    return values[:, 0] if plan.label.kind is ColumnKind.SCALAR else values


def bad_label_rows(values: np.ndarray, kind: LabelKind) -> np.ndarray | None:
    """Rows whose label the loss cannot use, or None when all are fine."""
    if kind is LabelKind.REAL:
        bad = ~np.isfinite(values).reshape(len(values), -1).all(axis=1)
    else:
        bad = (np.floor(values) != values) | (values < 0) | ~np.isfinite(values)
    return bad if bad.any() else None


def as_label(values: np.ndarray, kind: LabelKind) -> np.ndarray:
    if kind is LabelKind.REAL:
        return np.ascontiguousarray(values, dtype=np.float32)
    return values.astype(np.int64)


def decode_column(column: pa.Array | pa.ChunkedArray, spec: ColumnSpec) -> np.ndarray:
    """One column as a 2-D numpy array [rows, width]; raises BadDataError on nulls or ragged rows."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.null_count:
        raise BadDataError(
            f"column {spec.name!r} has {column.null_count} null rows of {len(column)}; "
            "drop or impute them (df.na.drop / Imputer) before fit",
            column=spec.name,
            bad_rows=column.null_count,
        )
    if spec.kind is ColumnKind.SCALAR:
        return _numeric_to_numpy(column, spec.name).reshape(-1, 1)
    if spec.kind is ColumnKind.ARRAY:
        return _array_to_numpy(column, spec.name)
    return _vector_to_numpy(column, spec.name)


def _numeric_to_numpy(values: pa.Array, name: str) -> np.ndarray:
    if values.null_count:
        raise BadDataError(
            f"column {name!r} has {values.null_count} null elements", column=name, bad_rows=values.null_count
        )
    if pa.types.is_boolean(values.type):
        values = values.cast(pa.int8())
    return values.to_numpy(zero_copy_only=False)


def _array_to_numpy(column: pa.Array, name: str) -> np.ndarray:
    rows = len(column)
    if pa.types.is_fixed_size_list(column.type):
        width = column.type.list_size
        return _numeric_to_numpy(column.flatten(), name).reshape(rows, width)
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    width = int(lengths[0]) if rows else 0
    ragged = lengths != width
    if ragged.any():
        raise BadDataError(
            f"array column {name!r} has rows of different lengths: {int(ragged.sum())} of {rows} "
            f"rows differ from the first row's length {width} (lengths seen: "
            f"{sorted(set(lengths.tolist()))[:5]}); pad or truncate them to one length",
            column=name,
            bad_rows=int(ragged.sum()),
        )
    return _numeric_to_numpy(column.flatten(), name).reshape(rows, width)


def _vector_to_numpy(column: pa.StructArray, name: str) -> np.ndarray:
    """Dense and sparse ml Vectors into one dense matrix, scattered without a Python loop."""
    rows = len(column)
    kinds = pc.struct_field(column, "type").to_numpy(zero_copy_only=False)
    values_list = pc.struct_field(column, "values")
    lengths = pc.list_value_length(values_list).fill_null(0).to_numpy(zero_copy_only=False)
    flat_values = _numeric_to_numpy(values_list.flatten(), name)
    sparse = kinds == 0
    sizes = pc.struct_field(column, "size").fill_null(0).to_numpy(zero_copy_only=False)
    widths = np.where(sparse, sizes, lengths)
    width = int(widths[0]) if rows else 0
    ragged = widths != width
    if ragged.any():
        raise BadDataError(
            f"vector column {name!r} has vectors of different sizes: {int(ragged.sum())} of {rows} "
            f"rows differ from the first row's size {width}",
            column=name,
            bad_rows=int(ragged.sum()),
        )
    if not sparse.any():
        return flat_values.reshape(rows, width)
    out = np.zeros((rows, width), dtype=flat_values.dtype)
    row_of_value = np.repeat(np.arange(rows), lengths)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    col_of_value = np.arange(len(flat_values)) - np.repeat(starts, lengths)
    sparse_values = np.repeat(sparse, lengths)
    indices = pc.struct_field(column, "indices").flatten().to_numpy(zero_copy_only=False)
    col_of_value[sparse_values] = indices
    out[row_of_value, col_of_value] = flat_values
    return out


def _is_numeric(typ: pa.DataType) -> bool:
    return pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ)
