import threading
import time

import numpy as np
import pytest

from sparkdl.data.batching import epoch_rng, global_batch_rows, rebatch, shuffle_chunks, steps_in_epoch
from sparkdl.data.blocks import Block
from sparkdl.data.cache import BlockCache
from sparkdl.data.prefetch import Prefetcher


def chunks(sizes):
    start = 0
    for size in sizes:
        x = np.arange(start, start + size, dtype=np.float32).reshape(-1, 1)
        yield Block({"features": x}, x[:, 0].astype(np.int64))
        start += size


@pytest.mark.parametrize("sizes", [[10], [3, 3, 3, 1], [1] * 7 + [20], [0, 5, 0, 12], []])
def test_rebatch_gives_fixed_batches_in_order(sizes):
    batches = list(rebatch(chunks(sizes), 4))
    total = sum(sizes)
    assert [len(b.inputs["features"]) for b in batches] == [4] * (total // 4) + (
        [total % 4] if total % 4 else []
    )
    flat = np.concatenate([b.label for b in batches]) if batches else np.zeros(0)
    np.testing.assert_array_equal(flat, np.arange(total))
    for b in batches:
        np.testing.assert_array_equal(b.inputs["features"][:, 0].astype(np.int64), b.label)


def test_step_schedule_for_uneven_partitions():
    counts = [10, 3, 0]
    assert steps_in_epoch(counts, 4) == 3
    assert [global_batch_rows(counts, 4, k) for k in range(3)] == [7, 4, 2]
    assert steps_in_epoch([0, 0], 4) == 0


def test_epoch_shuffles_are_seeded_per_epoch_and_rank():
    a = epoch_rng(0, 2, 1).permutation(100)
    np.testing.assert_array_equal(a, epoch_rng(0, 2, 1).permutation(100))
    assert not np.array_equal(a, epoch_rng(0, 3, 1).permutation(100))
    assert not np.array_equal(a, epoch_rng(0, 2, 0).permutation(100))
    (block,) = shuffle_chunks(chunks([50]), epoch_rng(0, 1, 0))
    y = block.label
    assert sorted(y.tolist()) == list(range(50)) and y.tolist() != list(range(50))
    np.testing.assert_array_equal(block.inputs["features"][:, 0].astype(np.int64), y)


def test_cache_replays_what_was_written(tmp_path):
    with BlockCache(str(tmp_path)) as cache:
        for block in chunks([5, 7]):
            cache.append(block)
        cache.seal()
        assert cache.rows == 12
        in_order = list(cache.batches(5))
        assert [len(b.label) for b in in_order] == [5, 5, 2]
        np.testing.assert_array_equal(np.concatenate([b.label for b in in_order]), np.arange(12))
        np.testing.assert_array_equal(
            np.concatenate([b.inputs["features"][:, 0] for b in in_order]), np.arange(12, dtype=np.float32)
        )
        order = epoch_rng(1, 2, 0).permutation(12)
        shuffled = list(cache.batches(5, order))
        np.testing.assert_array_equal(np.concatenate([b.label for b in shuffled]), order)
        np.testing.assert_array_equal(np.concatenate([b.inputs["features"][:, 0] for b in shuffled]), order)
        folder = cache._dir
    assert not folder.exists()


@pytest.mark.parametrize("memory_bytes", [1 << 20, 100])  # 100: the second chunk spills both
def test_a_cache_within_its_memory_budget_writes_nothing_and_replays_the_same_rows(tmp_path, memory_bytes):
    blocks = list(chunks([5, 7]))
    with BlockCache(str(tmp_path), memory_bytes) as cache:
        for block in blocks:
            cache.append(block)
        cache.seal()
        spilled = list(tmp_path.iterdir())
        assert cache.in_memory == (memory_bytes > 100) and bool(spilled) == (not cache.in_memory)
        order = epoch_rng(1, 2, 0).permutation(12)
        for _ in range(2):  # replays again from the joined (or mapped) rows
            shuffled = list(cache.batches(5, order))
            np.testing.assert_array_equal(np.concatenate([b.label for b in shuffled]), order)
            np.testing.assert_array_equal(
                np.concatenate([b.inputs["features"][:, 0] for b in shuffled]), order.astype(np.float32)
            )
        in_order = next(cache.batches(5))
        # replayed rows are read-only, on disk or not: a model changing its batch in place
        # gets a copy (tensors.to_batch), never the cache's rows
        assert not in_order.inputs["features"].flags.writeable and not in_order.label.flags.writeable
    assert not list(tmp_path.iterdir())


def test_cache_rejects_a_chunk_of_another_shape(tmp_path):
    with BlockCache(str(tmp_path), memory_bytes=1 << 20) as cache:  # checked in memory too
        cache.append(Block({"features": np.zeros((2, 3), np.float32)}, np.zeros(2, np.int64)))
        with pytest.raises(ValueError, match="differs from the first"):
            cache.append(Block({"features": np.zeros((2, 4), np.float32)}, np.zeros(2, np.int64)))


def test_empty_cache_replays_nothing(tmp_path):
    with BlockCache(str(tmp_path)) as cache:
        cache.seal()
        assert list(cache.batches(4)) == []


def test_prefetch_preserves_order_and_reraises_errors():
    assert list(Prefetcher(iter(range(20)), depth=3)) == list(range(20))

    def failing():
        yield 1
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        list(Prefetcher(failing(), depth=2))


def test_prefetch_close_stops_a_producer_blocked_on_a_full_queue():
    produced = []

    def endless():
        for i in range(10_000):
            produced.append(i)
            yield i

    prefetcher = Prefetcher(endless(), depth=2, group=4)
    time.sleep(0.2)
    prefetcher.close(timeout=5)
    assert not any(t.name == "sparkdl-prefetch" and t.is_alive() for t in threading.enumerate())
    assert len(produced) <= 4 * (2 + 2)  # stopped at the queue bound, not run to the end


def test_prefetch_groups_hand_offs_but_keeps_every_item():
    assert list(Prefetcher(iter(range(37)), depth=2, group=8)) == list(range(37))


def test_prefetch_depth_zero_runs_inline():
    prefetcher = Prefetcher(iter([1, 2]), depth=0)
    assert prefetcher._thread is None and list(prefetcher) == [1, 2]
