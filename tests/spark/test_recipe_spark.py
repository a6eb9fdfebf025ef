"""The training recipe through real Spark: validation, early stopping, schedules, precision."""

from __future__ import annotations

import pytest
import torch

from sparkdl import TorchEstimator
from tests.reference import make_learnable_shards, make_tiny_net, max_abs_diff
from tests.spark.test_fit import shards_dataframe

pytestmark = pytest.mark.spark


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def estimator(**settings):
    base = dict(
        model_fn=make_tiny_net,
        optimizer_fn=_sgd,
        loss_fn="cross_entropy",
        num_workers=2,
        batch_size=8,
        seed=0,
        shuffle=False,
        progress=False,
        collective_timeout_s=60.0,
    )
    return TorchEstimator(**{**base, **settings})


def test_a_validation_fraction_is_measured_every_epoch_and_never_trained_on(spark):
    shards = make_learnable_shards([150, 150])
    df = shards_dataframe(spark, shards)
    model = estimator(epochs=3, validation=0.25).fit(df)
    for record in model.history:
        assert {"val_loss", "val_accuracy", "val_samples"} <= record.keys()
        assert record["samples"] + record["val_samples"] == 300  # every row, once, on one side
    assert 40 < model.history[0]["val_samples"] < 110  # a seeded draw of about 75
    assert model.history[-1]["val_loss"] < model.history[0]["val_loss"]
    assert model.history[-1]["val_accuracy"] > 0.8


@pytest.mark.parametrize(
    "settings",
    [{"strategy": "allreduce"}, {"strategy": "parameter_server", "ps_mode": "sync"}],
    ids=["allreduce", "parameter_server"],
)
def test_early_stopping_stops_when_validation_worsens_and_keeps_the_best_epochs_weights(spark, settings):
    from pyspark.sql import functions as F

    shards = make_learnable_shards([96, 96])
    train = shards_dataframe(spark, shards)
    # the same rows, labelled otherwise: the better the model fits train, the worse it validates
    contrary = train.withColumn("label", (F.col("label") + 1) % 3)
    model = estimator(epochs=6, validation=contrary, early_stopping_patience=1, **settings).fit(train)
    assert len(model.history) < 6, [h["val_loss"] for h in model.history]
    best = min(range(len(model.history)), key=lambda i: model.history[i]["val_loss"])
    assert model.history[-1]["restored_epoch"] == best + 1
    # the same training (the same rows on the same workers), stopped there by its epochs
    one_run = estimator(epochs=best + 1, validation=contrary, **settings).fit(train)
    assert max_abs_diff(model.module.state_dict(), one_run.module.state_dict()) < 1e-6


@pytest.mark.parametrize("strategy", ["weight_averaging", "parameter_server"])
def test_the_whole_recipe_together_trains_in_every_strategy(spark, strategy):
    shards = make_learnable_shards([200, 180])
    model = estimator(
        strategy=strategy,
        epochs=4,
        batch_size=4,
        accumulate_steps=2,
        precision="bf16",
        lr_schedule="warmup_cosine",
        warmup_steps=5,
        grad_clip_norm=1.0,
        validation=0.2,
    ).fit(shards_dataframe(spark, shards))
    assert model.history[-1]["val_accuracy"] > 0.8, model.history[-1]
    assert all(p.dtype == torch.float32 for p in model.module.parameters())
