"""fit(rdd): RDDs of tuples, dicts and Rows train as the equivalent DataFrame does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkdl import SchemaError, TorchEstimator
from tests.reference import make_shards, make_tiny_net, max_abs_diff, reference_sgd

pytestmark = pytest.mark.spark

LR, MOMENTUM = 0.1, 0.9


def estimator(**settings):
    base = dict(
        model_fn=make_tiny_net,
        optimizer_fn=lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM),
        loss_fn="cross_entropy",
        num_workers=2,
        batch_size=8,
        epochs=2,
        seed=0,
        shuffle=False,
        progress=False,
    )
    return TorchEstimator(**{**base, **settings})


def shards_rdd(spark, shards, record):
    """One partition per shard, records in shard order, built on the executors."""
    records = [[record(x[i], y[i]) for i in range(len(y))] for x, y in shards]
    return spark.sparkContext.parallelize(range(len(shards)), len(shards)).flatMap(lambda i: records[i])


@pytest.mark.parametrize(
    "record",
    [
        lambda x, y: (x, y),  # (numpy float32 array, numpy int64)
        lambda x, y: {"features": x.tolist(), "label": int(y)},
    ],
    ids=["numpy_tuples", "dicts_of_lists"],
)
def test_an_rdd_trains_exactly_as_single_process_sgd(spark, record):
    shards = make_shards([40, 33])
    model = estimator().fit(shards_rdd(spark, shards, record))
    assert max_abs_diff(model.module.state_dict(), reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, False)) < 1e-5
    assert model.worker_rows == [40, 33]


def test_an_rdd_of_rows_with_ml_vectors_and_named_columns(spark):
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import Row

    shards = make_shards([30, 30])
    rdd = shards_rdd(spark, shards, lambda x, y: Row(vec=Vectors.dense(x.tolist()), target=float(y)))
    model = estimator(feature_cols=["vec"], label_col="target", epochs=1).fit(rdd)
    assert model.worker_rows == [30, 30] and model.trained_input_shapes == {"features": (6,)}


def test_an_empty_rdd_or_an_untypeable_record_fails_on_the_driver(spark):
    empty = spark.sparkContext.parallelize([], 2)
    with pytest.raises(SchemaError, match="has no records"):
        estimator().fit(empty)
    with pytest.raises(SchemaError, match="RDD of Rows, dicts or"):
        estimator().fit(spark.sparkContext.parallelize([np.zeros(3)], 1))
