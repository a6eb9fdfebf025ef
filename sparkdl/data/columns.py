"""Arrow columns -> numpy arrays, straight from Arrow buffers.

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

from sparkdl.data.blocks import Ragged
from sparkdl.errors import BadDataError, SchemaError


class ColumnKind(str, enum.Enum):
    """How one column turns into feature or label values."""

    SCALAR = "scalar"  # a numeric column: one value per row
    ARRAY = "array"  # array<numeric>: fixed length per row (or a declared sequence)
    NESTED = "nested"  # array<array<...numeric>>: an N-d block per row
    VECTOR = "vector"  # pyspark.ml Vector (dense or sparse), as its Arrow struct
    IMAGE = "image"  # Spark's image data source struct (height, width, nChannels, data)
    BYTES = "bytes"  # binary or string: only transform_fn can read it


class LabelKind(str, enum.Enum):
    """What the loss expects the label to be."""

    CLASS_INDEX = "class_index"  # int64 class ids (cross entropy)
    REAL = "real"  # float32 targets (mse, bce_with_logits, custom losses)


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    kind: ColumnKind


IMAGE_FIELDS = frozenset({"height", "width", "nChannels", "data"})
VECTOR_FIELDS = frozenset({"type", "values", "indices", "size"})


def kind_of_arrow_type(name: str, typ: pa.DataType) -> ColumnKind:
    """Classify an Arrow type, or raise a SchemaError saying which types are accepted."""
    if _is_numeric(typ):
        return ColumnKind.SCALAR
    if _is_list(typ) and _is_numeric(typ.value_type):
        return ColumnKind.ARRAY
    if _is_list(typ) and _is_list(typ.value_type):
        inner = typ.value_type
        while _is_list(inner):
            inner = inner.value_type
        if _is_numeric(inner):
            return ColumnKind.NESTED
    if pa.types.is_struct(typ):
        fields = {typ.field(i).name for i in range(typ.num_fields)}
        if fields >= VECTOR_FIELDS:
            return ColumnKind.VECTOR
        if fields >= IMAGE_FIELDS:
            return ColumnKind.IMAGE
    if any(
        check(typ)
        for check in (
            pa.types.is_binary,
            pa.types.is_large_binary,
            pa.types.is_string,
            pa.types.is_large_string,
        )
    ):
        return ColumnKind.BYTES
    raise SchemaError(
        f"column {name!r} has type {typ}, which cannot feed a model; use a numeric column, an "
        "array of numbers (nested arrays too), a pyspark.ml Vector (e.g. from VectorAssembler), "
        "an image column (spark.read.format('image')), or decode it in transform_fn"
    )


def flat_rows(values: np.ndarray) -> np.ndarray:
    """``[rows, ...]`` as ``[rows, values per row]``; unlike ``reshape(rows, -1)`` this also
    works for no rows or empty rows (an empty batch, a batch of empty sequences)."""
    return values.reshape(len(values), int(np.prod(values.shape[1:])))


def nonfinite_rows(matrix: np.ndarray) -> np.ndarray | None:
    """Mask of rows holding NaN or inf, or None when there are none."""
    # One cheap pass over every batch: a NaN or inf anywhere makes the sum of the whole
    # matrix non-finite (float32 or wider, 5x faster than float64 row sums). Only a non-finite
    # sum looks row by row: the bad rows, or none when large finite values overflowed it.
    with np.errstate(over="ignore", invalid="ignore"):
        total = matrix.sum(dtype=np.float32 if matrix.dtype.itemsize < 4 else None) if matrix.size else 0.0
    if np.isfinite(total):
        return None
    bad = ~np.isfinite(flat_rows(matrix)).all(axis=1)
    return bad if bad.any() else None


def decode_label(batch: pa.RecordBatch, spec: ColumnSpec, kind: LabelKind) -> np.ndarray:
    """The label column as int64 class ids or float32 targets."""
    return checked_label(label_values(batch, spec), spec.name, kind)


def checked_label(values: np.ndarray, name: str, kind: LabelKind) -> np.ndarray:
    """Label values (from the column, or from transform_fn) checked and typed for the loss."""
    bad = bad_label_rows(values, kind)
    if bad is not None and kind is LabelKind.REAL:
        raise BadDataError(
            f"label column {name!r} holds NaN or infinite values in {int(bad.sum())} rows",
            column=name,
            bad_rows=int(bad.sum()),
        )
    if bad is not None:
        example = values[bad][0]
        if np.ndim(example):  # a row of class ids per position: show a bad one
            example = example[~_class_ids(example)][0].item()
        raise BadDataError(
            f"label column {name!r} must hold class indices 0..C-1 for cross entropy, "
            f"but {int(bad.sum())} rows hold negative or non-integer values "
            f"(e.g. {example!r}); index the labels (StringIndexer) first",
            column=name,
            bad_rows=int(bad.sum()),
        )
    return as_label(values, kind)


def label_values(batch: pa.RecordBatch, spec: ColumnSpec) -> np.ndarray:
    """The raw label values ([rows] for a scalar label), before any check."""
    values = decode_column(batch.column(spec.name), spec)
    return values[:, 0] if spec.kind is ColumnKind.SCALAR else values


def decode_weight(batch: pa.RecordBatch, spec: ColumnSpec) -> np.ndarray:
    """Per-row loss weights as float32 ``[rows]``: finite and not negative."""
    return checked_weight(decode_column(batch.column(spec.name), spec)[:, 0], spec.name)


def checked_weight(values: np.ndarray, name: str) -> np.ndarray:
    """Weights (from the column, or from transform_fn) as float32, finite and not negative."""
    values = values.astype(np.float32)
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        raise BadDataError(
            f"weight column {name!r} holds negative, NaN or infinite weights in {int(bad.sum())} "
            f"of {len(values)} rows; weights must be finite and >= 0",
            column=name,
            bad_rows=int(bad.sum()),
        )
    return values


def bad_label_rows(values: np.ndarray, kind: LabelKind) -> np.ndarray | None:
    """Rows whose label the loss cannot use, or None when all are fine."""
    if kind is LabelKind.REAL:
        bad = ~np.isfinite(flat_rows(values)).all(axis=1)
    else:  # a class id per row, or one per position (a row is bad if any of its ids is)
        bad = ~_class_ids(flat_rows(values)).all(axis=1)
    return bad if bad.any() else None


def _class_ids(values: np.ndarray) -> np.ndarray:
    """Where ``values`` are class ids: finite whole numbers, not negative."""
    return np.isfinite(values) & (np.floor(values) == values) & (values >= 0)


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
    if pa.types.is_boolean(values.type):  # a flag is a number (float32), not an id (int64)
        values = values.cast(pa.float32())
    return values.to_numpy(zero_copy_only=False)


def _array_to_numpy(column: pa.Array, name: str) -> np.ndarray:
    rows = len(column)
    if pa.types.is_fixed_size_list(column.type):
        width = column.type.list_size
        return _elements(column, name).reshape(rows, width)
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    width = int(lengths[0]) if rows else 0
    ragged = lengths != width
    if ragged.any():
        raise BadDataError(
            f"array column {name!r} has rows of different lengths: {int(ragged.sum())} of {rows} "
            f"rows differ from the first row's length {width} (lengths seen: "
            f"{sorted(set(lengths.tolist()))[:5]}); pad or truncate them to one length, or list the "
            "column in sequence_cols to feed it padded per batch with a mask",
            column=name,
            bad_rows=int(ragged.sum()),
        )
    return _elements(column, name).reshape(rows, width)


def _elements(column: pa.Array, name: str) -> np.ndarray:
    """The numbers of an array column, flattened; a null among them is a BadDataError."""
    flat = column.flatten()
    _refuse_null_elements(column, flat, 1, name)
    return _numeric_to_numpy(flat, name)


def _refuse_null_elements(column: pa.Array, leaves: pa.Array, depth: int, name: str) -> None:
    """Raise a BadDataError for null numbers inside the arrays of ``column`` (``leaves``: its
    numbers, ``depth`` levels of arrays down): how many rows hold one, the first, and the fixes."""
    if not leaves.null_count:
        return
    rows = np.unique(_row_of(column, depth)[pc.is_null(leaves).to_numpy(zero_copy_only=False)])
    first = repr(column[int(rows[0])].as_py())
    first = first if len(first) <= 60 else first[:56] + " ..."
    fill, numbers = "lambda x: F.coalesce(x, F.lit(0.0))", repr(name)
    for level in range(depth - 1):  # array<array<...>>: one F.transform per level reaches the numbers
        fill, numbers = f"lambda a{level}: F.transform(a{level}, {fill})", f"F.flatten({numbers})"
    nulls = leaves.null_count
    raise BadDataError(
        f"array column {name!r}: {len(rows)} of {len(column)} rows of this batch hold a null element "
        f"({nulls} null{'s' if nulls > 1 else ''} in all; the first in row {int(rows[0])}: {first}); "
        "a null inside an array is never read as 0: fill the nulls before fit "
        f"(df.withColumn({name!r}, F.transform({name!r}, {fill})), F = pyspark.sql.functions), "
        f"drop those rows (df.where(~F.exists({numbers}, lambda x: x.isNull()))), "
        "or set on_bad_rows = 'skip' to leave them out and count them",
        column=name,
        bad_rows=len(rows),
    )


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


def _is_list(typ: pa.DataType) -> bool:
    return pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)


def _is_numeric(typ: pa.DataType) -> bool:
    return pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ)


# --------------------------------------------------------------------------- one column, its own shape


def natural_dtype(values: np.ndarray) -> np.ndarray:
    """Integers as int64 (ids for ``nn.Embedding``), everything else as float32."""
    if values.dtype.kind in "iu":
        return values.astype(np.int64, copy=False)
    return values.astype(np.float32, copy=False)


def decode_natural(
    column: pa.Array | pa.ChunkedArray, spec: ColumnSpec, shape: tuple[int, ...] = ()
) -> np.ndarray:
    """One column as ``[rows, *row_shape]`` in its own dtype: a number per row is ``[rows]``,
    an array ``[rows, k]`` (or ``shape`` when given), a nested array ``[rows, a, b, ...]``,
    a Vector ``[rows, size]``, an image uint8 ``[rows, channels, height, width]`` (RGB)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    _refuse_nulls(column, spec.name)
    if spec.kind is ColumnKind.IMAGE:
        values = decode_image(column, spec.name)
    elif spec.kind is ColumnKind.NESTED:
        values = _nested_to_numpy(column, spec.name)
    elif spec.kind is ColumnKind.SCALAR:
        values = _numeric_to_numpy(column, spec.name)
    else:
        values = decode_column(column, spec)
    values = natural_dtype(values) if spec.kind is not ColumnKind.IMAGE else values
    if shape:
        return reshape_rows(values, shape, spec.name)
    return values


def reshape_rows(values: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
    """``[rows, ...]`` viewed as ``[rows, *shape]``; a SchemaError when the sizes differ."""
    per_row = int(np.prod(values.shape[1:])) if values.ndim > 1 else 1
    if len(values) and per_row != int(np.prod(shape)):  # no rows (all screened out) fit any shape
        raise SchemaError(
            f"input_shapes gives column {name!r} the shape {list(shape)} ({int(np.prod(shape))} values "
            f"per row), but its rows hold {per_row} values ({list(values.shape[1:])}); fix input_shapes"
        )
    return values.reshape(len(values), *shape)


def decode_sequence(column: pa.Array | pa.ChunkedArray, spec: ColumnSpec) -> Ragged:
    """An array column whose rows may differ in length, as values + offsets."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    _refuse_nulls(column, spec.name)
    if spec.kind is not ColumnKind.ARRAY:
        raise SchemaError(
            f"sequence column {spec.name!r} must be an array of numbers, not {column.type}; "
            "remove it from sequence_cols"
        )
    offsets = _list_offsets(column)
    values = natural_dtype(_elements(column, spec.name))
    return Ragged(values, offsets - offsets[0])


def decode_image(column: pa.StructArray, name: str) -> np.ndarray:
    """Spark image structs (BGR(A) bytes, row-major, 8 bits per channel) as uint8
    ``[rows, channels, height, width]`` in RGB(A) order, as torchvision expects.

    Every image of a batch must have one size (resize them in transform_fn otherwise);
    the bytes are reshaped in one piece, never row by row.
    """
    rows = len(column)
    heights = pc.struct_field(column, "height").to_numpy(zero_copy_only=False)
    widths = pc.struct_field(column, "width").to_numpy(zero_copy_only=False)
    channels = pc.struct_field(column, "nChannels").to_numpy(zero_copy_only=False)
    if not rows:
        return np.zeros((0, 0, 0, 0), dtype=np.uint8)
    size = (int(heights[0]), int(widths[0]), int(channels[0]))
    differ = (heights != size[0]) | (widths != size[1]) | (channels != size[2])
    if differ.any():
        raise BadDataError(
            f"image column {name!r} holds images of different sizes: {int(differ.sum())} of {rows} rows "
            f"differ from the first row's {size[0]}x{size[1]} with {size[2]} channels; resize them "
            "(e.g. in transform_fn, or before fit)",
            column=name,
            bad_rows=int(differ.sum()),
        )
    data = pc.struct_field(column, "data")
    offsets = _list_offsets(data)
    expected = size[0] * size[1] * size[2]
    wrong = np.diff(offsets) != expected
    if wrong.any():
        raise BadDataError(
            f"image column {name!r}: {int(wrong.sum())} of {rows} rows hold a number of bytes other than "
            f"height x width x nChannels = {expected}; only 8-bit images are supported",
            column=name,
            bad_rows=int(wrong.sum()),
        )
    raw = np.frombuffer(data.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    pixels = raw.reshape(rows, *size)
    if size[2] >= 3:  # OpenCV's BGR(A), as Spark stores it, to RGB(A)
        pixels = pixels[..., [2, 1, 0, *range(3, size[2])]]
    return np.ascontiguousarray(pixels.transpose(0, 3, 1, 2))


def _list_offsets(column: pa.Array) -> np.ndarray:
    """A list or binary array's offsets as int64 ``[rows + 1]``, honouring a slice's offset."""
    rows = len(column)
    if pa.types.is_fixed_size_list(column.type):
        size = column.type.list_size
        return (np.arange(rows + 1, dtype=np.int64) + column.offset) * size
    if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
        kind = np.int64 if pa.types.is_large_binary(column.type) else np.int32
        offsets = np.frombuffer(column.buffers()[1], dtype=kind)
        return offsets[column.offset : column.offset + rows + 1].astype(np.int64)
    return np.asarray(column.offsets, dtype=np.int64)


def _nested_to_numpy(column: pa.Array, name: str) -> np.ndarray:
    """``array<array<...>>`` as one N-d block per row; every level must have one length."""
    rows = len(column)
    shape: list[int] = []
    level = column
    while _is_list(level.type):
        lengths = pc.list_value_length(level).to_numpy(zero_copy_only=False)
        width = int(lengths[0]) if len(lengths) else 0
        ragged = lengths != width
        if ragged.any():
            bad = len(np.unique(_row_of(column, len(shape))[ragged]))
            raise BadDataError(
                f"nested array column {name!r} has rows of different shapes: {bad} of {rows} rows differ "
                f"from the first row at depth {len(shape) + 1} (length {width}); every row must have "
                f"one shape, e.g. {[*shape, width]}",
                column=name,
                bad_rows=bad,
            )
        shape.append(width)
        if level.null_count:
            _refuse_nulls(level, name)
        level = level.flatten()
    _refuse_null_elements(column, level, len(shape), name)
    return _numeric_to_numpy(level, name).reshape(rows, *shape)


def _row_of(column: pa.Array, depth: int) -> np.ndarray:
    """For each element of the list level at ``depth`` (0: the rows), the row it is in."""
    rows = np.arange(len(column))
    level = column
    for _ in range(depth):
        rows = rows[pc.list_parent_indices(level).to_numpy(zero_copy_only=False)]
        level = level.flatten()
    return rows


def _refuse_nulls(column: pa.Array, name: str) -> None:
    if column.null_count:
        raise BadDataError(
            f"column {name!r} has {column.null_count} null rows of {len(column)}; "
            "drop or impute them (df.na.drop / Imputer) before fit",
            column=name,
            bad_rows=column.null_count,
        )
