"""Ids -> embeddings: matrix factorisation on a MovieLens-like ratings table, against Spark's ALS.

Run it with ``.venv/bin/python examples/recommender.py``. It generates ratings from a low-rank model
plus noise (seeded, nothing downloaded), trains a biased matrix factorisation with sparkdl
(``inputs`` passes the integer id columns to the model as int64 tensors), fits
``pyspark.ml.recommendation.ALS`` on the same split, and prints both test RMSEs and fit
times as one JSON line.
"""

from __future__ import annotations

import json
import tempfile
import time

import numpy as np
import torch
from pyspark.ml.evaluation import RegressionEvaluator
from pyspark.ml.recommendation import ALS
from torch import nn

import sparkdl

REG = 0.1  # L2 per rating, for both models


class MatrixFactorization(nn.Module):
    """rating ~ mean + user bias + item bias + <user vector, item vector>."""

    def __init__(self, n_users: int, n_items: int, dim: int, mean: float) -> None:
        super().__init__()
        self.user_vec = nn.Embedding(n_users, dim)
        self.item_vec = nn.Embedding(n_items, dim)
        self.user_bias = nn.Embedding(n_users, 1)
        self.item_bias = nn.Embedding(n_items, 1)
        for table in (self.user_vec, self.item_vec):
            nn.init.normal_(table.weight, std=0.1)
        for table in (self.user_bias, self.item_bias):
            nn.init.zeros_(table.weight)
        self.mean = mean

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        # user, item: int64 [N], straight from the integer columns
        dot = (self.user_vec(user) * self.item_vec(item)).sum(dim=1)
        bias = self.user_bias(user).squeeze(1) + self.item_bias(item).squeeze(1)
        return self.mean + bias + dot


def adam_with_l2_per_rating(params, lr: float = 0.02, reg: float = REG) -> torch.optim.Optimizer:
    """Adam with an L2 penalty of ``reg`` per rating on the rows it uses, as ALS's regParam.

    A row of a table with n rows takes part in about 1/n of the ratings of a batch, so the
    penalty's gradient is the weight decay 2 * reg / n, one for each table (every parameter
    of MatrixFactorization is a table: its length is its number of rows).
    """
    return torch.optim.Adam([{"params": [p], "weight_decay": 2 * reg / len(p)} for p in params], lr=lr)


def ratings(spark, n_users: int, n_items: int, n_ratings: int, rank: int = 4, seed: int = 0):
    """A DataFrame (user_id, item_id, rating): integer stars 1..5 from a rank-``rank`` model
    with user and item biases and noise, for ``n_ratings`` distinct (user, item) pairs."""
    rng = np.random.default_rng(seed)
    users = rng.normal(0, 1, (n_users, rank)) / np.sqrt(rank)
    items = rng.normal(0, 1, (n_items, rank)) / np.sqrt(rank)
    user_bias, item_bias = rng.normal(0, 0.5, n_users), rng.normal(0, 0.5, n_items)
    pairs = rng.choice(n_users * n_items, size=n_ratings, replace=False)
    u, i = pairs // n_items, pairs % n_items
    score = 3.5 + user_bias[u] + item_bias[i] + (users[u] * items[i]).sum(1) + rng.normal(0, 0.5, n_ratings)
    stars = np.clip(np.rint(score), 1, 5)
    rows = [(int(a), int(b), float(r)) for a, b, r in zip(u, i, stars, strict=True)]
    return spark.createDataFrame(rows, "user_id int, item_id int, rating double")


def main(
    spark=None,
    n_users: int = 300,
    n_items: int = 200,
    n_ratings: int = 20_000,
    epochs: int = 10,
    dim: int = 8,
    progress: bool = True,
) -> dict:
    """Train both models on one 80/20 split; return their test RMSEs and fit times."""
    spark = spark or sparkdl.session("local[2]", "recommender")
    train, test = ratings(spark, n_users, n_items, n_ratings).randomSplit([0.8, 0.2], seed=42)
    train, test = train.cache(), test.cache()
    mean = train.agg({"rating": "avg"}).first()[0]
    rmse = RegressionEvaluator(labelCol="rating", predictionCol="prediction", metricName="rmse")

    estimator = sparkdl.TorchEstimator(
        model_fn=lambda: MatrixFactorization(n_users, n_items, dim, mean),
        optimizer_fn=adam_with_l2_per_rating,
        loss_fn="mse",
        inputs={"user": "user_id", "item": "item_id"},  # forward(user=..., item=...)
        label_col="rating",
        num_workers=2,
        batch_size=128,
        epochs=epochs,
        seed=0,
        progress=progress,
    )
    start = time.perf_counter()
    model = estimator.fit(train)
    sparkdl_fit_s = time.perf_counter() - start
    sparkdl_rmse = rmse.evaluate(model.transform(test))

    if spark.sparkContext.getCheckpointDir() is None:
        # ALS cuts its lineage at checkpoints; without them a long lineage can overflow the JVM stack
        spark.sparkContext.setCheckpointDir(tempfile.mkdtemp(prefix="als-checkpoints-"))
    als = ALS(
        userCol="user_id",
        itemCol="item_id",
        ratingCol="rating",
        rank=dim,
        regParam=REG,
        maxIter=10,
        checkpointInterval=5,
        coldStartStrategy="drop",  # leave out test rows whose user or item never trained
        seed=0,
    )
    start = time.perf_counter()
    als_model = als.fit(train)
    als_fit_s = time.perf_counter() - start
    als_rmse = rmse.evaluate(als_model.transform(test))

    baseline_rmse = float(np.sqrt(test.selectExpr(f"avg(pow(rating - {mean}, 2))").first()[0]))
    return {
        "train_rows": train.count(),
        "test_rows": test.count(),
        "sparkdl_rmse": round(sparkdl_rmse, 4),
        "als_rmse": round(als_rmse, 4),
        "global_mean_rmse": round(baseline_rmse, 4),
        "sparkdl_fit_s": round(sparkdl_fit_s, 1),
        "als_fit_s": round(als_fit_s, 1),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
