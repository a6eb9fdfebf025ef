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


def counting_rows(spark, n, seed):
    """Rows of 3 to 10 tokens counting up mod 20 from a random start: each next token is
    the current one plus one, which a language model learns."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        start, length = int(rng.integers(0, 20)), int(rng.integers(3, 11))
        rows.append(([(start + i) % 20 for i in range(length)],))
    return spark.createDataFrame(rows, "tokens array<int>").repartition(2)


def tiny_gpt2():
    """A 1-layer GPT-2 over the 20-token vocabulary, no dropout."""
    config = transformers.GPT2Config(
        vocab_size=20, n_embd=32, n_layer=1, n_head=2, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def test_a_transformers_causal_lm_learns_the_next_token_without_a_label_column(spark):
    """``loss_fn = "causal_lm"``: the targets are each position's next token of the sequence
    input (padding and each row's last position left out), so the table needs no label;
    validation reports the held-out perplexity's log, and transform each position's
    predicted next token."""
    est = TorchEstimator(
        model_fn=tiny_gpt2,
        optimizer_fn=lambda p: torch.optim.Adam(p, lr=1e-2),
        loss_fn="causal_lm",
        inputs={"input_ids": "tokens"},
        sequence_cols=["tokens"],
        mask_input="attention_mask",
        validation_fraction=0.2,
        num_workers=2,
        batch_size=32,
        epochs=6,
        progress=False,
    )
    model = est.fit(counting_rows(spark, 500, 3))
    first, last = model.history[0], model.history[-1]
    assert last["loss"] < 0.3 * first["loss"], (first, last)
    assert last["val_loss"] < 0.5 and last["val_accuracy"] > 0.9, last  # perplexity exp(val_loss) < 1.65
    rows = model.transform(counting_rows(spark, 50, 4)).select("tokens", "prediction").collect()
    hits = [
        int(p) == (t + 1) % 20 for row in rows for t, p in zip(row.tokens[:-1], row.prediction, strict=False)
    ]
    assert sum(hits) / len(hits) > 0.9, sum(hits) / len(hits)
