"""One worker's batches for each epoch: streamed from Spark once, then replayed locally.

Epoch 1 decodes Arrow record batches as Spark delivers them, appends them to the
local epoch cache (decoded rows; or the raw rows when transform_fn must run every
epoch), and trains on them at the same time. Epochs 2+ replay the cache with a seeded
per-epoch shuffle. Decoding, transform_fn, padding and tensors all happen on the
prefetch thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from sparkdl.data.batching import epoch_rng, rebatch, shuffle_chunks
from sparkdl.data.blocks import Block
from sparkdl.data.cache import ArrowCache, BlockCache
from sparkdl.data.decoding import decode_block
from sparkdl.data.inputs import DataPlan
from sparkdl.data.pool import shared_pool
from sparkdl.data.prefetch import Prefetcher, mapped
from sparkdl.data.screening import RowScreen
from sparkdl.data.tensors import Batch, to_batch


@dataclass(frozen=True)
class FeedOptions:
    batch_size: int
    shuffle: bool
    seed: int
    rank: int
    prefetch_batches: int
    cache_dir: str = ""
    cache_memory_bytes: int = 0  # decoded rows kept in memory (fit: data.cache_memory_mb); 0 = disk
    # seconds this process keeps a closed memory cache's pages for the next (data.cache_memory_keep_s)
    cache_memory_keep_s: float = 0.0
    pin_memory: bool = False
    skip_bad_rows: bool = False


class PartitionFeed:
    """Batches of one partition, epoch after epoch.

    Args:
        source: the Arrow record batches of this worker's partition (read once).
        plan: which columns to decode and how.
        options: batch size, shuffling and prefetch settings.
    """

    def __init__(self, source: Iterator[pa.RecordBatch], plan: DataPlan, options: FeedOptions) -> None:
        self._source: Iterator[pa.RecordBatch] | None = source
        self._plan = plan
        self._options = options
        pool = None
        if options.cache_memory_bytes > 0 and options.cache_memory_keep_s > 0:
            pool = shared_pool()
            # a partition within the budget, as chunks and then joined (held-out rows past
            # that go back, the oldest first)
            pool.configure(options.cache_memory_keep_s, 2 * options.cache_memory_bytes)
        self._cache: BlockCache | ArrowCache = (
            ArrowCache(self._decode, options.cache_dir)
            if plan.transforms_every_epoch
            else BlockCache(options.cache_dir, options.cache_memory_bytes, pool)
        )
        self._open: Prefetcher[Batch] | None = None
        self._screen = RowScreen(plan) if options.skip_bad_rows else None
        # rows held out to validate: decoded once (training=False: no augmentation), never trained on
        self._held_out = (
            BlockCache(options.cache_dir, options.cache_memory_bytes, pool) if plan.validation_col else None
        )

    @property
    def bad_rows_dropped(self) -> int:
        """Rows left out by ``on_bad_rows = "skip"`` (final once the stream was read)."""
        return self._screen.dropped if self._screen else 0

    @property
    def cached_rows(self) -> int:
        """Rows of this partition; final once the first epoch has been read."""
        return self._cache.rows

    @property
    def streaming(self) -> bool:
        """True until the Spark stream has been read to its end once."""
        return not self._cache.sealed

    def epoch(self, epoch: int) -> tuple[Prefetcher[Batch], str]:
        """Start feeding ``epoch`` (1-based); the previous epoch's feed must be drained.

        Returns:
            the batches, and where they come from: "spark" (first read, streamed)
            or "cache" (replayed). Decided here, before the prefetch thread starts,
            since that thread may finish the stream at any moment.
        """
        self._close_open()
        source = "spark" if self.streaming else "cache"
        blocks = self._stream(epoch) if source == "spark" else self._replay(epoch)
        self._open = Prefetcher(mapped(blocks, self._to_batch), self._options.prefetch_batches)
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

    def _stream(self, epoch: int) -> Iterator[Block]:
        if self._source is None:
            raise RuntimeError("the Spark stream was already consumed but the cache is not sealed")
        source, self._source = self._source, None
        chunks: Iterator[Block] = self._decode_and_cache(source)
        if self._options.shuffle:
            chunks = shuffle_chunks(chunks, epoch_rng(self._options.seed, epoch, self._options.rank))
        # Blocks are decoded once per Arrow chunk, and batches are views into them: the
        # per-batch work is a few slices and the tensors wrapped around them.
        return rebatch(chunks, self._options.batch_size)

    @property
    def validation_rows(self) -> int:
        """Rows held out to validate (final once the stream was read)."""
        return self._held_out.rows if self._held_out is not None else 0

    def validation_batches(self, batch_size: int) -> Iterator[Batch]:
        """The held-out rows, in order, once the stream has been read."""
        if self._held_out is None or not self._held_out.sealed:
            return iter(())
        return mapped(self._held_out.batches(batch_size), self._to_batch)

    def _decode_and_cache(self, source: Iterator[pa.RecordBatch]) -> Iterator[Block]:
        for record_batch in source:
            if self._screen is not None:
                record_batch = self._screen.screen(record_batch)
            if self._held_out is not None:
                record_batch = self._hold_out(record_batch)
            if record_batch.num_rows == 0:
                continue
            block = self._decode(record_batch)
            if isinstance(self._cache, ArrowCache):
                self._cache.append(record_batch)
            else:
                self._cache.append(block)
            yield block
        self._cache.seal()
        if self._held_out is not None:
            self._held_out.seal()

    def _hold_out(self, record_batch: pa.RecordBatch) -> pa.RecordBatch:
        """Cache the validation rows of ``record_batch``; return its training rows."""
        assert self._held_out is not None and self._plan.validation_col is not None
        marks = pc.fill_null(record_batch.column(self._plan.validation_col), False)
        held = record_batch.filter(marks)
        if held.num_rows:
            self._held_out.append(decode_block(held, self._plan, training=False))
        return record_batch.filter(pc.invert(marks))

    def _decode(self, record_batch: pa.RecordBatch) -> Block:
        return decode_block(record_batch, self._plan, training=True)

    def _replay(self, epoch: int) -> Iterator[Block]:
        order = None
        if self._options.shuffle:
            order = epoch_rng(self._options.seed, epoch, self._options.rank).permutation(self._cache.rows)
        return self._cache.batches(self._options.batch_size, order)

    def _to_batch(self, block: Block) -> Batch:
        return to_batch(block, self._plan, self._options.pin_memory)

    def _close_open(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None

    def close(self) -> None:
        """Stop prefetching and delete the local cache."""
        self._close_open()
        self._cache.close()
        if self._held_out is not None:
            self._held_out.close()
