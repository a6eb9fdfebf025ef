"""The workload shared by every benchmark: synthetic data and one model, seeded."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

WIDTH, CLASSES = 64, 10


def make_data(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Linearly separable-ish 10-class data: labels are argmax of a fixed projection."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, WIDTH)).astype(np.float32)
    w = rng.normal(size=(WIDTH, CLASSES)).astype(np.float32)
    y = (x @ w).argmax(axis=1).astype(np.int64)
    return x, y


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)
