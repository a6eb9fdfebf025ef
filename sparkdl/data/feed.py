"""One worker's batches for each epoch: streamed from Spark once, then replayed locally.

Epoch 1 decodes Arrow record batches as Spark delivers them, appends them to the
local :class:`PartitionCache`, and trains on them at the same time. Epochs 2+
replay the cache with a seeded per-epoch shuffle. Both run on a prefetch thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from sparkdl.data.batching import Arrays, epoch_rng, rebatch, shuffle_chunks
from sparkdl.data.cache import PartitionCache
from sparkdl.data.columns import ColumnPlan, decode_features, decode_label
from sparkdl.data.prefetch import Prefetcher, mapped
from sparkdl.data.screening import RowScreen


@dataclass(frozen=True)
class FeedOptions:
    batch_size: int
    shuffle: bool
    seed: int
    rank: int
    prefetch_batches: int
    cache_dir: str = ""
    pin_memory: bool = False
    skip_bad_rows: bool = False


TensorBatch = tuple[torch.Tensor, torch.Tensor]


class PartitionFeed:
    """Batches of one partition, epoch after epoch.

    Args:
        source: the Arrow record batches of this worker's partition (read once).
        plan: which columns to decode and how.
        options: batch size, shuffling and prefetch settings.
    """

    def __init__(self, source: Iterator[pa.RecordBatch], plan: ColumnPlan, options: FeedOptions) -> None:
        self._source: Iterator[pa.RecordBatch] | None = source
        self._plan = plan
        self._options = options
        self._cache = PartitionCache(options.cache_dir)
        self._open: Prefetcher[TensorBatch] | None = None
        self._screen = RowScreen(plan) if options.skip_bad_rows else None

    @property
    def bad_rows_dropped(self) -> int:
        """Rows left out by ``on_bad_rows = "skip"`` (final once the stream was read)."""
        return self._screen.dropped if self._screen else 0

    @property
    def cached_rows(self) -> int:
        """Rows of this partition; final once the first epoch has been read."""
        return self._cache.rows

    def widths(self) -> tuple[int, int]:
        """Feature and label widths of the cached rows ((0, 1) when it holds none)."""
        return self._cache.widths()

    @property
    def streaming(self) -> bool:
        """True until the Spark stream has been read to its end once."""
        return not self._cache.sealed

    def epoch(self, epoch: int) -> tuple[Prefetcher[TensorBatch], str]:
        """Start feeding ``epoch`` (1-based); the previous epoch's feed must be drained.

        Returns:
            the batches, and where they come from: "spark" (first read, streamed)
            or "cache" (replayed). Decided here, before the prefetch thread starts,
            since that thread may finish the stream at any moment.
        """
        self._close_open()
        source = "spark" if self.streaming else "cache"
        batches = self._stream(epoch) if source == "spark" else self._replay(epoch)
        self._open = Prefetcher(batches, self._options.prefetch_batches)
        return self._open, source

    def fill_cache(self) -> None:
        """Read the whole Spark stream into the cache without training on it.

        Used when resuming past epoch 1: the new attempt must rebuild its cache
        before it can replay the epoch it resumes in.
        """
        if self.streaming and self._source is not None:
            source, self._source = self._source, None
            for _ in self._decode_and_cache(source):
                pass

    def _stream(self, epoch: int) -> Iterator[TensorBatch]:
        if self._source is None:
            raise RuntimeError("the Spark stream was already consumed but the cache is not sealed")
        source, self._source = self._source, None
        chunks: Iterator[Arrays] = self._decode_and_cache(source)
        if self._options.shuffle:
            chunks = shuffle_chunks(chunks, epoch_rng(self._options.seed, epoch, self._options.rank))
        # Tensors are made once per Arrow chunk (one copy, one pin), and batches are
        # views into them: per-batch work stays at a few microseconds.
        return rebatch(mapped(chunks, self._to_tensors), self._options.batch_size, torch.cat)

    def _decode_and_cache(self, source: Iterator[pa.RecordBatch]) -> Iterator[Arrays]:
        for record_batch in source:
            if record_batch.num_rows == 0:
                continue
            if self._screen is not None:
                x, y = self._screen.decode(record_batch)
                if not len(x):
                    continue
            else:
                x = decode_features(record_batch, self._plan)
                y = decode_label(record_batch, self._plan)
            self._cache.append(x, y)
            yield x, y
        self._cache.seal()

    def _replay(self, epoch: int) -> Iterator[TensorBatch]:
        order = None
        if self._options.shuffle:
            order = epoch_rng(self._options.seed, epoch, self._options.rank).permutation(self._cache.rows)
        return mapped(self._cache.batches(self._options.batch_size, order), self._to_tensors)

    def _to_tensors(self, arrays: Arrays) -> TensorBatch:
        x, y = (a if a.flags.writeable else np.array(a) for a in arrays)
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        if self._options.pin_memory:
            tx, ty = tx.pin_memory(), ty.pin_memory()
        return tx, ty

    def _close_open(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None

    def close(self) -> None:
        """Stop prefetching and delete the local cache."""
        self._close_open()
        self._cache.close()
