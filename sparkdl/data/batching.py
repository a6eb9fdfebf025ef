"""Turning a stream of decoded chunks into fixed-size batches, and seeded shuffles.

Pure numpy: no Spark, no torch, so every rule here is unit-tested directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

Arrays = tuple[np.ndarray, np.ndarray]


def rebatch(chunks: Iterable[Arrays], batch_size: int) -> Iterator[Arrays]:
    """Yield batches of exactly ``batch_size`` rows (the last one may be smaller).

    Chunks arrive in whatever sizes Arrow delivers them; rows keep their order.
    A chunk that already holds whole batches is sliced without copying.
    """
    pending_x: list[np.ndarray] = []
    pending_y: list[np.ndarray] = []
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
            yield np.concatenate(pending_x), np.concatenate(pending_y)
            pending_x, pending_y, pending = [], [], 0
        while len(x) - start >= batch_size:
            yield x[start : start + batch_size], y[start : start + batch_size]
            start += batch_size
        if start < len(x):
            pending_x, pending_y, pending = [x[start:]], [y[start:]], len(x) - start
    if pending:
        yield np.concatenate(pending_x), np.concatenate(pending_y)


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
