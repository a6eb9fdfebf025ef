"""Reference answers computed another way: plain single-process PyTorch SGD."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from sparkdl.data.batching import epoch_rng
from sparkdl.data.columns import LabelKind
from sparkdl.data.decoding import decode_block
from sparkdl.data.inputs import DataPlan, plan_data
from sparkdl.data.tensors import Batch, to_batch


class TinyNet(nn.Module):
    """Small but not linear, so a wrong average shows up in every layer."""

    def __init__(self, width: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, 8), nn.Tanh(), nn.Linear(8, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def momentum_sgd(params, lr: float = 0.1, momentum: float = 0.9) -> torch.optim.Optimizer:
    """The Spark tests' optimizer (tests.spark.test_fit's ``estimator``): defined here, in a
    module the workers import cheaply, since a pickled function is imported by its module."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def make_tiny_net() -> nn.Module:
    return TinyNet()


def make_deep_net() -> nn.Module:
    """Seven top-level layers of an nn.Sequential, four with parameters: a model a pipeline
    cuts into 2 or 4 stages."""
    layers = [
        nn.Linear(6, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 3),
    ]
    return nn.Sequential(*layers)


def split_the_first_pair(module: nn.Module, mesh) -> None:
    """A user's own tensor-parallel split of :func:`make_deep_net` (``parallelize_fn``): its
    first pair of linear layers over the group, the second left whole on every worker."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(module, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


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
    shards,
    batch_size: int,
    epochs: int,
    seed: int,
    lr: float,
    momentum: float,
    shuffle: bool,
    model_fn: Callable[[], nn.Module] = make_tiny_net,
) -> dict[str, torch.Tensor]:
    """One process, global batch = union of each worker's slice of the step, mean loss."""
    torch.manual_seed(seed)
    model = model_fn()
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
            out = model(x)  # flattened, as a language model's loss is written: (N T, C) against (N T)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def shard_plan(shards) -> tuple[DataPlan, Batch]:
    """The plan of the shards' columns (feature_cols = features, a class label) and the
    template batch the driver would decode: the first two rows of the first shard with rows."""
    first = next((shard_to_batch(*s) for s in shards if len(s[1])), shard_to_batch(*shards[0]))
    plan = plan_data(
        first.schema, feature_cols=("features",), label_col="label", label_kind=LabelKind.CLASS_INDEX
    )
    return plan, to_batch(decode_block(first.slice(0, 2), plan), plan)


class TwoInputNet(nn.Module):
    """A user id through an embedding, joined with a dense row: ``model(user=..., dense=...)``."""

    def __init__(self, users: int = 12, width: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(users, 4)
        self.body = nn.Sequential(nn.Linear(4 + width, 16), nn.Tanh(), nn.Linear(16, classes))

    def forward(self, user: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.body(torch.cat([self.embed(user), dense], dim=1))


def make_two_input_net() -> nn.Module:
    return TwoInputNet()


def make_two_input_shards(sizes: Sequence[int], users: int = 12, seed: int = 11):
    """Per worker: (user ids int64, dense float32 [n, 6], class labels int64)."""
    rng = np.random.default_rng(seed)
    shards = []
    for n in sizes:
        user = rng.integers(0, users, n).astype(np.int64)
        dense = rng.normal(size=(n, 6)).astype(np.float32)
        label = ((user % 3) + (dense[:, 0] > 0)).astype(np.int64) % 3
        shards.append((user, dense, label))
    return shards


def reference_sgd_two_inputs(
    shards, batch_size: int, epochs: int, seed: int, lr: float, momentum: float
) -> dict[str, torch.Tensor]:
    """:func:`reference_sgd` for :class:`TwoInputNet` (rows in order, no shuffle)."""
    torch.manual_seed(seed)
    model = make_two_input_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    steps = max((len(s[2]) + batch_size - 1) // batch_size for s in shards)
    for _ in range(epochs):
        for step in range(steps):
            rows = slice(step * batch_size, (step + 1) * batch_size)
            user, dense, label = (
                torch.from_numpy(np.concatenate([s[i][rows] for s in shards])) for i in range(3)
            )
            loss = F.cross_entropy(model(user=user, dense=dense), label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_learnable_shards(sizes: Sequence[int], width: int = 6, seed: int = 3):
    """Like :func:`make_shards`, but the class is the largest of the first three features
    (a linear rule a small model learns in a few epochs)."""
    rng = np.random.default_rng(seed)
    shards = []
    for size in sizes:
        x = rng.normal(size=(size, width)).astype(np.float32)
        shards.append((x, x[:, :3].argmax(axis=1).astype(np.int64)))
    return shards
