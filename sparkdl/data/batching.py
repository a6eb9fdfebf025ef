"""Turning a stream of decoded chunks into fixed-size batches, and seeded shuffles.

Pure numpy: no Spark, no torch, so every rule here is unit-tested directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

Arrays = tuple[np.ndarray, np.ndarray]
A = TypeVar("A", bound=Any)


def rebatch(
    chunks: Iterable[tuple[A, A]], batch_size: int, concat: Callable[[list[A]], A]
) -> Iterator[tuple[A, A]]:
    """Yield batches of exactly ``batch_size`` rows (the last one may be smaller).

    Chunks arrive in whatever sizes Arrow delivers them; rows keep their order.
    Batches inside a chunk are slices (views, no copy); only a batch that spans two
    chunks is concatenated. Works on numpy arrays (``concat=np.concatenate``) and
    on tensors (``concat=torch.cat``).
    """
    pending_x: list[A] = []
    pending_y: list[A] = []
    pending = 0
    for x, y in chunks:
        start = 0
        if pending:
            take = min(batch_size - pending, len(x))
            pending_x.append(x[:take])
            pending_y.append(y[:take])
            pending += take
            start = take
            if pending < batch_size:
                continue
            yield concat(pending_x), concat(pending_y)
            pending_x, pending_y, pending = [], [], 0
        while len(x) - start >= batch_size:
            yield x[start : start + batch_size], y[start : start + batch_size]
            start += batch_size
        if start < len(x):
            pending_x, pending_y, pending = [x[start:]], [y[start:]], len(x) - start
    if pending:
        yield concat(pending_x), concat(pending_y)


def epoch_rng(seed: int, epoch: int, rank: int) -> np.random.Generator:
    """The random stream of one worker in one epoch: reproducible, independent per rank."""
    return np.random.default_rng([seed, epoch, rank])


def shuffle_chunks(chunks: Iterable[Arrays], rng: np.random.Generator) -> Iterator[Arrays]:
    """Permute rows within each chunk (epoch 1, while the data still streams from Spark)."""
    for x, y in chunks:
        order = rng.permutation(len(x))
        yield x[order], y[order]


def steps_in_epoch(counts: Sequence[int], batch_size: int) -> int:
    """Steps every worker takes when worker r holds ``counts[r]`` rows."""
    return max((c + batch_size - 1) // batch_size for c in counts) if counts else 0


def global_batch_rows(counts: Sequence[int], batch_size: int, step: int) -> int:
    """Rows that all workers together contribute at ``step`` (0-based)."""
    return sum(min(batch_size, max(0, c - step * batch_size)) for c in counts)
