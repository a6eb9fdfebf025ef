"""Data sets that ship with installed packages, so jobs and tests run offline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sparkdl.errors import ConfigError


@dataclass(frozen=True)
class LabeledArrays:
    features: np.ndarray  # float32 [rows, width]
    labels: np.ndarray  # int64 [rows]
    num_classes: int


# The data sets load_arrays knows, with what they hold (shown by the main job's --help).
BUNDLED = {"digits": "scikit-learn's 1,797 8x8 handwritten digits (64 pixel features, 10 classes)"}


def load_arrays(name: str) -> LabeledArrays:
    """A bundled data set as arrays (:data:`BUNDLED` lists them).

    Raises:
        ConfigError: ``name`` is not bundled; the message lists the names that are.
    """
    if name == "digits":
        from sklearn.datasets import load_digits

        bunch = load_digits()
        features = (bunch.data / 16.0).astype(np.float32)  # pixel intensities 0..16 -> 0..1
        return LabeledArrays(features, bunch.target.astype(np.int64), 10)
    raise ConfigError(
        f"job.dataset = {name!r} is not bundled; choose one of {', '.join(map(repr, BUNDLED))}, "
        "or train on your own CSV/Parquet rows with jobs/etl_to_train.py"
    )


def train_test_split(
    data: LabeledArrays, test_fraction: float, seed: int
) -> tuple[LabeledArrays, LabeledArrays]:
    """A seeded random split into training and held-out rows."""
    order = np.random.default_rng(seed).permutation(len(data.labels))
    cut = round(len(order) * (1.0 - test_fraction))
    train, test = order[:cut], order[cut:]
    return (
        LabeledArrays(data.features[train], data.labels[train], data.num_classes),
        LabeledArrays(data.features[test], data.labels[test], data.num_classes),
    )


def to_dataframe(spark: Any, data: LabeledArrays, partitions: int | None = None) -> Any:
    """A DataFrame with ``features: array<float>`` and ``label: long`` columns, built via Arrow."""
    import pyarrow as pa

    width = data.features.shape[1]
    features = pa.FixedSizeListArray.from_arrays(pa.array(data.features.reshape(-1)), width)
    table = pa.table({"features": features.cast(pa.list_(pa.float32())), "label": pa.array(data.labels)})
    df = spark.createDataFrame(table)
    return df.repartition(partitions) if partitions else df
