import numpy as np
import pyarrow as pa
import pytest

from sparkdl import BadDataError, SchemaError
from sparkdl.data.columns import ColumnKind, LabelKind, decode_label
from sparkdl.data.decoding import decode_block
from sparkdl.data.inputs import POSITIONAL, plan_data

VECTOR = pa.struct(
    [
        ("type", pa.int8()),
        ("size", pa.int32()),
        ("indices", pa.list_(pa.int32())),
        ("values", pa.list_(pa.float64())),
    ]
)


def plan(batch, features, label="label", kind=LabelKind.CLASS_INDEX):
    return plan_data(batch.schema, feature_cols=tuple(features), label_col=label, label_kind=kind)


def features(batch, p):
    block = decode_block(batch, p)
    assert list(block.inputs) == [POSITIONAL] and not p.keyword
    return block.inputs[POSITIONAL]


def labels(batch, p):
    return decode_label(batch, p.label, p.label_kind)


def test_scalar_array_and_vector_columns_concatenate_in_order():
    batch = pa.RecordBatch.from_pydict(
        {
            "a": pa.array([1, 2, 3], pa.int32()),
            "arr": pa.array([[0.5, 1.5], [2.5, 3.5], [4.5, 5.5]], pa.list_(pa.float32())),
            "vec": pa.array(
                [
                    {"type": 1, "size": None, "indices": None, "values": [7.0, 8.0, 9.0]},
                    {"type": 0, "size": 3, "indices": [2], "values": [4.0]},
                    {"type": 0, "size": 3, "indices": [0, 1], "values": [1.0, -1.0]},
                ],
                VECTOR,
            ),
            "label": pa.array([0, 1, 2], pa.int64()),
        }
    )
    p = plan(batch, ["a", "arr", "vec"])
    assert [s.kind for s in p.features] == [ColumnKind.SCALAR, ColumnKind.ARRAY, ColumnKind.VECTOR]
    x = features(batch, p)
    assert x.dtype == np.float32 and x.shape == (3, 6)
    np.testing.assert_array_equal(
        x,
        [[1, 0.5, 1.5, 7, 8, 9], [2, 2.5, 3.5, 0, 0, 4], [3, 4.5, 5.5, 1, -1, 0]],
    )
    np.testing.assert_array_equal(labels(batch, p), [0, 1, 2])
    np.testing.assert_array_equal(decode_block(batch, p).label, [0, 1, 2])


def test_sliced_batches_decode_only_their_rows():
    batch = pa.RecordBatch.from_pydict(
        {
            "arr": pa.array([[float(i), float(i)] for i in range(10)], pa.list_(pa.float64())),
            "vec": pa.array(
                [{"type": 0, "size": 2, "indices": [i % 2], "values": [float(i)]} for i in range(10)], VECTOR
            ),
            "label": pa.array(range(10), pa.float64()),
        }
    ).slice(4, 3)
    p = plan(batch, ["arr", "vec"], kind=LabelKind.REAL)
    np.testing.assert_array_equal(features(batch, p), [[4, 4, 4, 0], [5, 5, 0, 5], [6, 6, 6, 0]])
    np.testing.assert_array_equal(labels(batch, p), [4.0, 5.0, 6.0])


def test_nulls_are_an_error_naming_column_and_count():
    batch = pa.RecordBatch.from_pydict(
        {"x": pa.array([1.0, None, None, 4.0]), "label": pa.array([0, 1, 0, 1])}
    )
    with pytest.raises(BadDataError, match=r"column 'x' has 2 null rows of 4") as info:
        features(batch, plan(batch, ["x"]))
    assert info.value.column == "x" and info.value.bad_rows == 2


FIX_FEATURES = (
    "a null inside an array is never read as 0: fill the nulls before fit "
    "(df.withColumn('features', F.transform('features', lambda x: F.coalesce(x, F.lit(0.0)))), "
    "F = pyspark.sql.functions), drop those rows (df.where(~F.exists('features', lambda x: x.isNull()))), "
    "or set on_bad_rows = 'skip' to leave them out and count them"
)


@pytest.mark.parametrize(
    "typ", [pa.list_(pa.float64()), pa.list_(pa.float32(), 3), pa.large_list(pa.float64())], ids=str
)
def test_a_null_element_inside_an_array_names_the_column_the_row_and_the_fix(typ):
    rows = [
        [0.0, 0.0, 0.0],
        [1.0, 1.0, 1.0],
        [2.0, 2.0, 2.0],
        [1.0, None, 3.0],
        [4.0, 5.0, 6.0],
        [None, None, 9.0],
    ]
    batch = pa.RecordBatch.from_pydict(
        {"features": pa.array(rows, typ), "label": pa.array([0, 1, 0, 1, 0, 1])}
    ).slice(2, 4)  # rows 0 and 1 of this batch are sound; its row 1 holds the first null
    with pytest.raises(BadDataError) as info:
        features(batch, plan(batch, ["features"]))
    assert str(info.value) == (
        "array column 'features': 2 of 4 rows of this batch hold a null element "
        f"(3 nulls in all; the first in row 1: [1.0, None, 3.0]); {FIX_FEATURES}"
    )
    assert info.value.column == "features" and info.value.bad_rows == 2


def test_a_null_element_inside_a_nested_array_gives_the_fix_for_its_depth():
    batch = pa.RecordBatch.from_pydict(
        {"features": pa.array([[[1.0], [2.0]], [[3.0], [None]]]), "label": pa.array([0, 1])}
    )
    p = plan_data(batch.schema, inputs={"x": "features"}, label_col="label")
    with pytest.raises(BadDataError) as info:
        decode_block(batch, p)
    message = str(info.value)
    assert message.startswith(
        "array column 'features': 1 of 2 rows of this batch hold a null element "
        "(1 null in all; the first in row 1: [[3.0], [None]]);"
    )
    assert (
        "F.transform('features', lambda a0: F.transform(a0, lambda x: F.coalesce(x, F.lit(0.0))))" in message
    )
    assert "df.where(~F.exists(F.flatten('features'), lambda x: x.isNull()))" in message
    assert info.value.column == "features" and info.value.bad_rows == 1


def test_ragged_arrays_are_an_error_with_the_count():
    batch = pa.RecordBatch.from_pydict(
        {"arr": pa.array([[1.0, 2.0], [1.0], [1.0, 2.0], [3.0, 4.0, 5.0]]), "label": pa.array([0, 0, 1, 1])}
    )
    with pytest.raises(BadDataError, match=r"'arr' has rows of different lengths: 2 of 4 rows") as info:
        features(batch, plan(batch, ["arr"]))
    assert info.value.column == "arr" and info.value.bad_rows == 2


def test_nan_features_are_counted_not_coerced():
    batch = pa.RecordBatch.from_pydict(
        {"x": pa.array([1.0, float("nan"), 3.0]), "label": pa.array([0, 1, 0])}
    )
    with pytest.raises(BadDataError, match=r"NaN or infinite values in 1 of 3 rows") as info:
        features(batch, plan(batch, ["x"]))
    assert info.value.column == "x" and info.value.bad_rows == 1


def test_large_finite_features_whose_float32_sum_overflows_are_not_bad_rows():
    big = float(np.finfo(np.float32).max) / 2  # any three of them overflow a float32 sum
    batch = pa.RecordBatch.from_pydict(
        {"x": pa.array([big, big, big, big], pa.float32()), "label": pa.array([0, 1, 0, 1])}
    )
    assert features(batch, plan(batch, ["x"])).tolist() == [[big]] * 4
    batch = pa.RecordBatch.from_pydict(
        {"x": pa.array([big, big, float("inf"), big], pa.float32()), "label": pa.array([0, 1, 0, 1])}
    )
    with pytest.raises(BadDataError, match=r"NaN or infinite values in 1 of 4 rows"):
        features(batch, plan(batch, ["x"]))


def test_unsupported_and_missing_columns_are_schema_errors():
    batch = pa.RecordBatch.from_pydict(
        {"s": pa.array(["a"]), "t": pa.array([0], pa.timestamp("s")), "label": pa.array([0])}
    )
    with pytest.raises(SchemaError, match=r"column 't' has type timestamp\[s\].*VectorAssembler"):
        plan(batch, ["t"])
    # a string column is readable by transform_fn only: the error says so
    with pytest.raises(SchemaError, match=r"column 's' \(string\) cannot join .*feature_cols.*transform_fn"):
        plan(batch, ["s"])
    with pytest.raises(SchemaError, match=r"\['nope'\] not found"):
        plan(batch, ["nope"])


def test_class_labels_must_be_non_negative_integers():
    batch = pa.RecordBatch.from_pydict({"x": pa.array([1.0, 2.0, 3.0]), "label": pa.array([0.0, 1.5, -1.0])})
    with pytest.raises(BadDataError, match=r"2 rows hold negative or non-integer values") as info:
        labels(batch, plan(batch, ["x"]))
    assert info.value.column == "label" and info.value.bad_rows == 2
    with pytest.raises(BadDataError, match=r"2 rows hold negative or non-integer values"):
        decode_block(batch, plan(batch, ["x"]))
    ok = pa.RecordBatch.from_pydict({"x": pa.array([1.0]), "label": pa.array([3.0])})
    assert labels(ok, plan(ok, ["x"])).dtype == np.int64
    np.testing.assert_array_equal(decode_block(ok, plan(ok, ["x"])).label, np.array([3], np.int64))


def test_array_labels_for_multi_output_regression():
    batch = pa.RecordBatch.from_pydict(
        {"x": pa.array([1.0, 2.0]), "y": pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float32()))}
    )
    p = plan(batch, ["x"], "y", LabelKind.REAL)
    y = labels(batch, p)
    assert y.shape == (2, 2) and y.dtype == np.float32
    np.testing.assert_array_equal(decode_block(batch, p).label, [[1.0, 2.0], [3.0, 4.0]])
