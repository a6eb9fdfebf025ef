"""Reference answers computed another way: plain single-process PyTorch SGD."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from sparkdl.data.batching import epoch_rng


class TinyNet(nn.Module):
    """Small but not linear, so a wrong average shows up in every layer."""

    def __init__(self, width: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, 8), nn.Tanh(), nn.Linear(8, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_tiny_net() -> nn.Module:
    return TinyNet()


def make_shards(sizes: Sequence[int], width: int = 6, classes: int = 3, seed: int = 7):
    """Deterministic (features, labels) per worker."""
    rng = np.random.default_rng(seed)
    shards = []
    for size in sizes:
        x = rng.normal(size=(size, width)).astype(np.float32)
        y = rng.integers(0, classes, size=size).astype(np.int64)
        shards.append((x, y))
    return shards


def shard_to_batch(x: np.ndarray, y: np.ndarray) -> pa.RecordBatch:
    width = x.shape[1] if x.ndim == 2 and len(x) else 6
    values = pa.array(x.reshape(-1), pa.float32())
    features = pa.FixedSizeListArray.from_arrays(values, width).cast(pa.list_(pa.float32()))
    return pa.RecordBatch.from_arrays([features, pa.array(y, pa.int64())], ["features", "label"])


def reference_sgd(
    shards, batch_size: int, epochs: int, seed: int, lr: float, momentum: float, shuffle: bool
) -> dict[str, torch.Tensor]:
    """One process, global batch = union of each worker's slice of the step, mean loss."""
    torch.manual_seed(seed)
    model = make_tiny_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for epoch in range(1, epochs + 1):
        orders = [
            epoch_rng(seed, epoch, rank).permutation(len(y)) if shuffle else np.arange(len(y))
            for rank, (_, y) in enumerate(shards)
        ]
        steps = max((len(y) + batch_size - 1) // batch_size for _, y in shards)
        for step in range(steps):
            picks = [order[step * batch_size : (step + 1) * batch_size] for order in orders]
            x = torch.from_numpy(np.concatenate([s[0][p] for s, p in zip(shards, picks, strict=True)]))
            y = torch.from_numpy(np.concatenate([s[1][p] for s, p in zip(shards, picks, strict=True)]))
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
