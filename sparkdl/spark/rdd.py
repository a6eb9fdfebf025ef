"""``fit(rdd)``: an RDD of records becomes the DataFrame it stands for, on the executors.

Records may be ``Row``s, dicts, or ``(features, label)`` tuples (columns ``features``
and ``label``, the default ``feature_cols`` and ``label_col``); values may be numbers,
lists, numpy arrays and scalars, ml Vectors, bytes or strings. The schema is read from
the first record (the only record the driver sees); every partition is converted where
it lives, so the DataFrame keeps the RDD's partitions and rows in order: a fit on it
trains exactly as on the equivalent DataFrame.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from sparkdl.errors import SchemaError

TUPLE_COLUMNS = ("features", "label")


def is_rdd(dataset: Any) -> bool:
    from pyspark import RDD

    return isinstance(dataset, RDD)


def rdd_to_dataframe(rdd: Any, spark: Any = None) -> Any:
    """The DataFrame of ``rdd``'s records (see the module docstring).

    Raises:
        SchemaError: the RDD is empty, or a record or value has a shape this cannot type.
    """
    from pyspark.sql import SparkSession

    spark = spark or SparkSession.builder.getOrCreate()
    first = rdd.take(1)
    if not first:
        raise SchemaError("the RDD given to fit has no records; check the filters upstream of fit")
    names, values = _fields(first[0])
    schema = _struct(names, values)
    return spark.createDataFrame(rdd.mapPartitions(_plain_partition), schema)


def _fields(record: Any) -> tuple[list[str], list[Any]]:
    if hasattr(record, "asDict"):  # a Row
        data = record.asDict()
        return list(data), list(data.values())
    if isinstance(record, Mapping):
        return [str(k) for k in record], list(record.values())
    if isinstance(record, tuple) and len(record) == 2:
        return list(TUPLE_COLUMNS), list(record)
    raise SchemaError(
        f"fit(rdd) takes an RDD of Rows, dicts or (features, label) tuples; its first record is "
        f"a {type(record).__name__}: map the RDD to one of those (e.g. rdd.map(lambda r: (x, y)))"
    )


def _plain_partition(records: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
    """Each record as a tuple of plain Python values (numpy arrays and scalars unwrapped)."""
    for record in records:
        _, values = _fields(record)
        yield tuple(_plain(v) for v in values)


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple) and value and isinstance(value[0], np.ndarray | np.generic | list):
        return [_plain(v) for v in value]
    return value


def _struct(names: list[str], values: list[Any]) -> Any:
    from pyspark.sql.types import StructField, StructType

    return StructType(
        [StructField(n, _spark_type(n, v), nullable=True) for n, v in zip(names, values, strict=True)]
    )


def _spark_type(name: str, value: Any) -> Any:
    from pyspark.ml.linalg import Vector, VectorUDT
    from pyspark.sql import types as T

    if isinstance(value, Vector):
        return VectorUDT()
    if isinstance(value, bool | np.bool_):
        return T.BooleanType()
    if isinstance(value, int | np.integer):
        return T.LongType()
    if isinstance(value, np.floating):
        return T.FloatType() if value.dtype == np.float32 else T.DoubleType()
    if isinstance(value, float):
        return T.DoubleType()
    if isinstance(value, bytes | bytearray):
        return T.BinaryType()
    if isinstance(value, str):
        return T.StringType()
    if isinstance(value, np.ndarray):
        element: Any = {
            "f": T.FloatType() if value.dtype == np.float32 else T.DoubleType(),
            "b": T.BooleanType(),
        }
        inner = element.get(value.dtype.kind, T.LongType() if value.dtype.kind in "iu" else None)
        if inner is None:
            raise SchemaError(f"field {name!r} holds a numpy array of {value.dtype}; use numbers")
        for _ in range(value.ndim):
            inner = T.ArrayType(inner, containsNull=False)
        return inner
    if isinstance(value, list | tuple):
        if not value:
            raise SchemaError(
                f"field {name!r} of the first record is an empty list; its element type is unknown"
            )
        return T.ArrayType(_spark_type(name, value[0]), containsNull=False)
    raise SchemaError(
        f"field {name!r} holds a {type(value).__name__}, which fit cannot type; use numbers, lists, "
        "numpy arrays, ml Vectors, bytes or strings"
    )
