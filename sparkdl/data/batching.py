"""Turning a stream of decoded chunks into fixed-size batches, and seeded shuffles.

Pure numpy (on :class:`~sparkdl.data.blocks.Block`): no Spark, no torch, so every rule
here is unit-tested directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from sparkdl.data.blocks import Block


def rebatch(chunks: Iterable[Block], batch_size: int) -> Iterator[Block]:
    """Yield blocks of exactly ``batch_size`` rows (the last one may be smaller).

    Chunks arrive in whatever sizes Arrow delivers them; rows keep their order.
    Batches inside a chunk are slices (views, no copy); only a batch that spans two
    chunks is concatenated.
    """
    pending: list[Block] = []
    held = 0
    for chunk in chunks:
        rows = len(chunk)
        start = 0
        if held:
            take = min(batch_size - held, rows)
            pending.append(chunk.rows(slice(0, take)))
            held += take
            start = take
            if held < batch_size:
                continue
            yield Block.concat(pending)
            pending, held = [], 0
        while rows - start >= batch_size:
            yield chunk.rows(slice(start, start + batch_size))
            start += batch_size
        if start < rows:
            pending, held = [chunk.rows(slice(start, rows))], rows - start
    if held:
        yield Block.concat(pending)


def epoch_rng(seed: int, epoch: int, rank: int) -> np.random.Generator:
    """The random stream of one worker in one epoch: reproducible, independent per rank."""
    return np.random.default_rng([seed, epoch, rank])


def shuffle_chunks(chunks: Iterable[Block], rng: np.random.Generator) -> Iterator[Block]:
    """Permute rows within each chunk (epoch 1, while the data still streams from Spark)."""
    for chunk in chunks:
        yield chunk.rows(rng.permutation(len(chunk)))


def steps_in_epoch(counts: Sequence[int], batch_size: int) -> int:
    """Steps every worker takes when worker r holds ``counts[r]`` rows."""
    return max((c + batch_size - 1) // batch_size for c in counts) if counts else 0


def global_batch_rows(counts: Sequence[int], batch_size: int, step: int) -> int:
    """Rows that all workers together contribute at ``step`` (0-based)."""
    return sum(min(batch_size, max(0, c - step * batch_size)) for c in counts)
