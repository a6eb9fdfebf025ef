"""Token ids of different lengths -> a bag-of-embeddings classifier, with padding and a mask.

Run it with ``.venv/bin/python examples/sequence_classifier.py``. It generates short "reviews" from
a tiny vocabulary (seeded, nothing downloaded): 3 to 20 token ids each, positive when
they hold more positive words than negative ones. The ``array<int>`` column is listed in
``sequence_cols``, so every batch is padded to its longest row and the model also gets
``tokens_mask`` (True on real tokens). It prints the held-out accuracy as one JSON line.
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from torch import nn

import sparkdl

POSITIVE = ["good", "great", "fun", "love", "superb", "enjoyable"]
NEGATIVE = ["bad", "awful", "boring", "hate", "dull", "terrible"]
NEUTRAL = ["the", "a", "movie", "plot", "actor", "was", "it", "and", "scene", "very", "film", "story"]
VOCAB = ["<pad>", *POSITIVE, *NEGATIVE, *NEUTRAL]  # id 0 is never a real token


class BagOfEmbeddings(nn.Module):
    """Mean of the real tokens' embeddings (the mask leaves the padding out), then Linear."""

    def __init__(self, vocab_size: int = len(VOCAB), dim: int = 16, classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.out = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor, tokens_mask: torch.Tensor) -> torch.Tensor:
        # tokens: int64 [N, L], padded per batch; tokens_mask: bool [N, L]
        mask = tokens_mask.unsqueeze(-1).float()
        pooled = (self.embed(tokens) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return self.out(pooled)


def reviews(spark, n: int, seed: int = 0):
    """A DataFrame (tokens array<int>, label long): 3..20 tokens, mostly neutral words; the
    label is 1 when positive words outnumber negative ones (ties are redrawn)."""
    rng = np.random.default_rng(seed)
    ids = {word: i for i, word in enumerate(VOCAB)}
    rows = []
    while len(rows) < n:
        length = int(rng.integers(3, 21))
        words = rng.choice(NEUTRAL, size=length).tolist()
        n_pos, n_neg = rng.integers(0, 4, size=2)
        if n_pos == n_neg:
            continue
        for word in [*rng.choice(POSITIVE, n_pos), *rng.choice(NEGATIVE, n_neg)]:
            words[int(rng.integers(0, length))] = word
        n_pos = sum(w in POSITIVE for w in words)  # a sentiment word may have overwritten another
        n_neg = sum(w in NEGATIVE for w in words)
        if n_pos != n_neg:
            rows.append(([ids[w] for w in words], int(n_pos > n_neg)))
    return spark.createDataFrame(rows, "tokens array<int>, label long")


def main(spark=None, n_rows: int = 4000, epochs: int = 10, progress: bool = True) -> dict:
    """Train on 80% of the reviews and return the accuracy on the other 20%."""
    spark = spark or sparkdl.session("local[2]", "sequence_classifier")
    train, test = reviews(spark, n_rows).randomSplit([0.8, 0.2], seed=42)
    estimator = sparkdl.TorchEstimator(
        model_fn=BagOfEmbeddings,
        optimizer_fn=lambda params: torch.optim.Adam(params, lr=0.02),
        loss_fn="cross_entropy",
        inputs={"tokens": "tokens"},
        sequence_cols=["tokens"],  # pad each batch, pass tokens_mask too
        label_col="label",
        num_workers=2,
        batch_size=64,
        epochs=epochs,
        seed=0,
        progress=progress,
    )
    start = time.perf_counter()
    model = estimator.fit(train)
    fit_s = time.perf_counter() - start
    accuracy = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy")
    return {
        "train_rows": train.count(),
        "test_rows": test.count(),
        "model_inputs": sorted(model.trained_input_shapes),  # tokens and tokens_mask
        "accuracy": round(accuracy.evaluate(model.transform(test)), 4),
        "fit_s": round(fit_s, 1),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
