"""Hugging Face transformers through real Spark: a model whose forward returns a
``ModelOutput`` and takes ``attention_mask`` trains and transforms like any other (issue 55).
Models are built from a config: no network."""

from __future__ import annotations

import pytest
import torch

from sparkdl import TorchEstimator
from tests.spark.test_inputs_spark import token_dataframe

pytestmark = pytest.mark.spark
transformers = pytest.importorskip("transformers")


def tiny_bert_classifier():
    """A 2-layer BERT for sequence classification over the 20-token vocabulary, no dropout."""
    config = transformers.BertConfig(
        vocab_size=20,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(config)


def test_a_transformers_classifier_trains_on_padded_token_ids_with_its_attention_mask_and_predicts(spark):
    train, test = token_dataframe(spark, 600, 1), token_dataframe(spark, 200, 2)
    est = TorchEstimator(
        model_fn=tiny_bert_classifier,
        optimizer_fn=lambda p: torch.optim.Adam(p, lr=3e-3),
        loss_fn="cross_entropy",
        inputs={"input_ids": "tokens"},
        sequence_cols=["tokens"],
        mask_input="attention_mask",
        num_workers=2,
        batch_size=32,
        epochs=8,
        progress=False,
    )
    model = est.fit(train)
    assert set(model.trained_input_shapes) == {"input_ids", "attention_mask"}  # the names it takes
    losses = [epoch["loss"] for epoch in model.history]
    assert losses[-1] < 0.5 * losses[0], losses
    predicted = model.transform(test).select("label", "prediction", "probability").toPandas()
    accuracy = float((predicted["label"] == predicted["prediction"]).mean())
    assert accuracy > 0.9, accuracy
    assert all(abs(sum(p) - 1) < 1e-5 for p in predicted["probability"])  # softmax of the logits
