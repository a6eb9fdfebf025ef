"""Typed inputs through real Spark: named inputs of several types, sequences, transform_fn."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl import TorchEstimator, TorchModel
from tests.reference import (
    make_two_input_net,
    make_two_input_shards,
    max_abs_diff,
    reference_sgd_two_inputs,
)

pytestmark = pytest.mark.spark

LR, MOMENTUM = 0.1, 0.9


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def two_input_dataframe(spark, shards):
    """One partition per shard, rows in order (partition i feeds rank i)."""
    from pyspark.sql import Row

    rows = [
        [Row(user=int(u[i]), dense=[float(v) for v in d[i]], label=int(y[i])) for i in range(len(y))]
        for u, d, y in shards
    ]
    rdd = spark.sparkContext.parallelize(range(len(shards)), len(shards)).flatMap(lambda i: rows[i])
    return spark.createDataFrame(rdd, "user int, dense array<float>, label long")


@pytest.mark.parametrize(
    "settings",
    [
        {"strategy": "allreduce"},
        {"strategy": "weight_averaging", "sync_every": 1},
        {"strategy": "parameter_server", "ps_mode": "sync"},
        {"strategy": "fsdp"},
    ],
    ids=["allreduce", "weight_averaging", "parameter_server", "fsdp"],
)
def test_a_two_input_model_trains_exactly_as_one_process_in_every_strategy(spark, settings):
    shards = make_two_input_shards([48, 29])  # uneven: the second worker runs out first
    est = TorchEstimator(
        model_fn=make_two_input_net,
        optimizer_fn=_sgd,
        loss_fn="cross_entropy",
        inputs={"user": "user", "dense": "dense"},
        label_col="label",
        num_workers=2,
        batch_size=8,
        epochs=2,
        seed=0,
        shuffle=False,
        progress=False,
        collective_timeout_s=60.0,
        **settings,
    )
    model = est.fit(two_input_dataframe(spark, shards))
    expected = reference_sgd_two_inputs(shards, 8, 2, 0, LR, MOMENTUM)
    assert max_abs_diff(model.module.state_dict(), expected) < 1e-5
    assert model.worker_rows == [48, 29]
    assert model.trained_input_shapes == {"user": (), "dense": (6,)}


class BagOfTokens(nn.Module):
    """Mean of the embeddings of the real tokens (the mask leaves the padding out)."""

    def __init__(self, vocab: int = 20) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor, tokens_mask: torch.Tensor) -> torch.Tensor:
        mask = tokens_mask.unsqueeze(-1).float()
        pooled = (self.embed(tokens) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.out(pooled)


def token_dataframe(spark, n: int, seed: int):
    """Sequences of 1-12 token ids; the label says whether token 7 occurs."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        tokens = rng.integers(0, 20, rng.integers(1, 13)).tolist()
        rows.append((tokens, int(7 in tokens)))
    return spark.createDataFrame(rows, "tokens array<int>, label long").repartition(2)


def test_sequences_of_different_lengths_train_padded_with_a_mask_and_predict(spark, tmp_path):
    train, test = token_dataframe(spark, 600, 1), token_dataframe(spark, 200, 2)
    est = TorchEstimator(
        model_fn=BagOfTokens,
        optimizer_fn=lambda p: torch.optim.Adam(p, lr=0.05),
        loss_fn="cross_entropy",
        inputs={"tokens": "tokens"},
        sequence_cols=["tokens"],
        num_workers=2,
        batch_size=32,
        epochs=8,
        progress=False,
    )
    model = est.fit(train)
    assert model.trained_input_shapes["tokens_mask"][0] <= 12
    predicted = model.transform(test).select("label", "prediction").toPandas()
    accuracy = float((predicted["label"] == predicted["prediction"]).mean())
    assert accuracy > 0.9, accuracy
    model.write().overwrite().save(str(tmp_path / "m"))
    loaded = TorchModel.load(str(tmp_path / "m"), model_fn=model.model_fn)
    again = loaded.transform(test).select("prediction").toPandas()
    assert (again["prediction"].to_numpy() == predicted["prediction"].to_numpy()).all()


def _decode_pixels(batch):
    """transform_fn: raw bytes -> a [N, 1, 4, 4] float image; the label too, where the rows
    have one (the docs allow it: the keys other than the label are inputs)."""
    raw = np.frombuffer(b"".join(batch.column("png").to_pylist()), dtype=np.uint8).reshape(-1, 1, 4, 4)
    decoded = {"image": raw.astype(np.float32) / 255.0}
    if "label" in batch.schema.names:
        decoded["label"] = batch.column("label").to_numpy()
    return decoded


def test_transform_fn_decodes_bytes_on_the_executors_in_fit_and_transform(spark):
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(400):
        label = int(rng.integers(0, 2))
        pixels = rng.integers(0, 100, 16, dtype=np.uint8) + (150 if label else 0)
        rows.append((bytes(pixels.astype(np.uint8)), label))
    df = spark.createDataFrame(rows, "png binary, label long").repartition(2)
    est = TorchEstimator(
        model_fn=lambda: nn.Sequential(nn.Flatten(), nn.Linear(16, 2)),
        optimizer_fn=lambda p: torch.optim.Adam(p, lr=0.05),
        loss_fn="cross_entropy",
        transform_fn=_decode_pixels,
        num_workers=2,
        batch_size=32,
        epochs=3,
        progress=False,
    )
    model = est.fit(df)
    assert model.trained_input_shapes == {"image": (1, 4, 4)}
    # held-out rows that still have their labels: transform leaves the label out, as fit does
    predicted = model.transform(df).select("label", "prediction").toPandas()
    assert float((predicted["label"] == predicted["prediction"]).mean()) > 0.95


def _two_input_estimator(**settings):
    base = dict(
        model_fn=make_two_input_net,
        optimizer_fn=_sgd,
        loss_fn="cross_entropy",
        inputs={"user": "user", "dense": "dense"},
        num_workers=2,
        batch_size=8,
        epochs=2,
        seed=0,
        shuffle=False,
        progress=False,
        collective_timeout_s=30.0,
    )
    return TorchEstimator(**{**base, **settings})


def test_a_worker_without_rows_steps_on_the_drivers_template_of_every_input(spark):
    shards = make_two_input_shards([40, 0])  # rank 1 never sees a row: it needs ids and a dense row
    model = _two_input_estimator().fit(two_input_dataframe(spark, shards))
    assert model.worker_rows == [40, 0]
    expected = reference_sgd_two_inputs(shards, 8, 2, 0, LR, MOMENTUM)
    assert max_abs_diff(model.module.state_dict(), expected) < 1e-5


@pytest.mark.slow
def test_a_two_input_run_resumes_from_its_checkpoint_with_identical_weights(spark, tmp_path):
    shards = make_two_input_shards([64, 64])
    df = two_input_dataframe(spark, shards)
    clean = _two_input_estimator(checkpoint_dir=str(tmp_path / "a"), checkpoint_every=4, shuffle=True).fit(df)
    marker = tmp_path / "fired"
    drilled = _two_input_estimator(
        checkpoint_dir=str(tmp_path / "b"),
        checkpoint_every=4,
        shuffle=True,
        fault_injection=f"raise:1:11:{marker}",
    ).fit(df)
    assert marker.exists()  # the drill did fire, and the stage was re-run from step 8
    assert max_abs_diff(drilled.module.state_dict(), clean.module.state_dict()) == 0.0
