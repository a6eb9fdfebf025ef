"""The host memory pool, and the epoch cache on top of it: the same rows, the same pages."""

import threading
import time

import numpy as np
import pytest

from sparkdl.data.batching import epoch_rng
from sparkdl.data.blocks import Block, Ragged
from sparkdl.data.cache import BlockCache, _nbytes
from sparkdl.data.pool import GRANULE, MIN_POOLED, BufferPool

MB = 1 << 20


@pytest.fixture
def pool():
    pool = BufferPool(keep_s=60, limit_bytes=1 << 30)
    yield pool
    pool.clear()  # and its releaser thread ends


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_a_given_buffer_is_taken_again_for_the_same_rounded_size(pool):
    first = pool.take(3 * MB + 5)
    assert len(first) == 3 * MB + GRANULE and first.flags.writeable
    where = address(first)
    given = [first]
    del first
    pool.give(given)
    assert given == [] and pool.free_bytes == 3 * MB + GRANULE
    again = pool.take(3 * MB + 100)  # rounds to the same size
    assert address(again) == where and pool.free_bytes == 0
    other = pool.take(2 * MB)  # no free buffer of this size: a new one
    assert address(other) != where


def test_a_buffer_that_is_still_read_is_not_taken_back_until_its_readers_are_gone(pool):
    buffer = pool.take(2 * MB)
    view = buffer[:MB].view(np.float32)
    buffers = [buffer]
    del buffer
    pool.give(buffers)
    assert len(buffers) == 1 and pool.free_bytes == 0  # the view still reads it: it stays with the caller
    view[:] = 7.0
    assert pool.take(2 * MB) is not buffers[0]  # never handed out while read
    del view
    pool.give(buffers)
    assert buffers == [] and pool.free_bytes == 2 * MB


def test_free_bytes_stay_within_the_limit_dropping_the_oldest(pool):
    pool.configure(keep_s=60, limit_bytes=5 * MB)
    taken = [pool.take(2 * MB) for _ in range(3)]
    newest = address(taken[-1])
    pool.give(taken)  # gives the last taken first: it is the oldest of the free ones
    assert pool.free_bytes == 4 * MB
    assert newest not in {address(pool.take(2 * MB)), address(pool.take(2 * MB))}


def test_small_buffers_and_a_pool_that_keeps_nothing_take_nothing_back(pool):
    small = [pool.take(MIN_POOLED - 1)]
    pool.give(small)
    assert small == [] and pool.free_bytes == 0
    pool.give([pool.take(2 * MB)])
    assert pool.free_bytes == 2 * MB
    pool.configure(keep_s=0, limit_bytes=64 * MB)  # keeping nothing from now: what it held goes too
    assert pool.free_bytes == 0
    pool.give([pool.take(2 * MB)])
    assert pool.free_bytes == 0


def test_idle_buffers_go_back_to_the_kernel_after_keep_s(pool):
    pool.configure(keep_s=0.2, limit_bytes=64 * MB)
    pool.give([pool.take(2 * MB)])
    assert pool.free_bytes == 2 * MB
    deadline = time.monotonic() + 10
    while pool.free_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.free_bytes == 0
    pool.give([pool.take(2 * MB)])  # a new releaser starts after the first ended
    while pool.free_bytes and time.monotonic() < deadline + 10:
        time.sleep(0.05)
    assert pool.free_bytes == 0


def test_each_free_buffer_goes_back_keep_s_after_it_was_given_though_others_are_taken(pool):
    pool.configure(keep_s=0.3, limit_bytes=64 * MB)
    pool.give([pool.take(4 * MB)])  # a size the later takes never ask for
    deadline = time.monotonic() + 10
    while pool.free_bytes != 3 * MB and time.monotonic() < deadline:  # a later fit of its own sizes
        pool.give([pool.take(3 * MB)])
        time.sleep(0.01)
    assert pool.free_bytes == 3 * MB  # the 4 MB buffer went, the one in use stays


def test_clear_returns_while_another_thread_keeps_giving(pool):
    stop = threading.Event()

    def give_and_take():
        for _ in range(20_000):  # bounded: about 10 s at most
            if stop.is_set():
                return
            pool.give([pool.take(MB)])
            time.sleep(0.0005)

    giver = threading.Thread(target=give_and_take)
    giver.start()
    try:
        worst = 0.0
        for _ in range(20):
            started = time.monotonic()
            pool.clear()
            worst = max(worst, time.monotonic() - started)
    finally:
        stop.set()
        giver.join(30)
    # a clear() that waited for a releaser kept alive by the giver stalled 5 s (its join's bound)
    assert worst < 2.5


def test_a_pooled_cache_joins_object_columns_in_plain_memory(tmp_path, pool):
    names = np.array([["a", 1]] * 50, dtype=object)
    with BlockCache(str(tmp_path), 1 << 30, pool) as cache:
        for start in (0, 50):
            cache.append(Block({"names": names}, np.arange(start, start + 50, dtype=np.int64)))
        cache.seal()
        (batch,) = cache.batches(100)
        assert batch.inputs["names"].tolist() == names.tolist() * 2
        np.testing.assert_array_equal(batch.label, np.arange(100))


def ragged_chunks(sizes, seed=0):
    rng = np.random.default_rng(seed)
    start = 0
    for size in sizes:
        x = np.arange(start, start + size, dtype=np.float32)[:, None] * np.ones((1, 2048), np.float32)
        lengths = rng.integers(0, 300, size)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = Ragged(np.arange(offsets[-1], dtype=np.int64) % 1000, offsets)
        yield Block({"features": x, "tokens": tokens}, np.arange(start, start + size, dtype=np.int64))
        start += size


def replay(cache, order):
    batches = list(cache.batches(64, order))
    features = np.concatenate([b.inputs["features"] for b in batches])
    tokens = [b.inputs["tokens"] for b in batches]
    rows = [t.values[t.offsets[i] : t.offsets[i + 1]].tolist() for t in tokens for i in range(len(t))]
    return features, rows, np.concatenate([b.label for b in batches])


def test_a_pooled_cache_replays_the_rows_of_a_plain_one_and_the_next_reuses_its_pages(tmp_path, pool):
    sizes = [300, 300, 300, 57]
    order = epoch_rng(0, 2, 0).permutation(sum(sizes))
    with BlockCache(str(tmp_path), 1 << 30) as plain:
        for block in ragged_chunks(sizes):
            plain.append(block)
        plain.seal()
        expected = replay(plain, order)
    addresses = []
    for _ in range(2):
        cache = BlockCache(str(tmp_path), 1 << 30, pool)
        for block in ragged_chunks(sizes):
            block.inputs["features"].flags.writeable = True
            cache.append(block)
            block.inputs["features"][:] = -1  # the source changes after: the cache kept a copy
        cache.seal()
        got = replay(cache, order)
        np.testing.assert_array_equal(got[0], expected[0])
        assert got[1] == expected[1]
        np.testing.assert_array_equal(got[2], expected[2])
        whole = cache._replayed()
        assert not whole.inputs["features"].flags.writeable
        assert not whole.inputs["tokens"].values.flags.writeable
        addresses.append(address(whole.inputs["features"]))
        # after the join only the joined columns are held: every chunk's buffer was given back
        assert pool.free_bytes >= sum(sizes) * 2048 * 4
        del whole, got
        cache.close()
        held = pool.free_bytes
        assert held >= 2 * sum(sizes) * 2048 * 4  # the chunks and the joined columns
    assert addresses[0] == addresses[1]  # the second cache's rows sit in the first one's pages
    assert pool.free_bytes == held
    assert not list(tmp_path.iterdir())


def test_a_batch_still_read_after_close_keeps_its_rows(tmp_path, pool):
    cache = BlockCache(str(tmp_path), 1 << 30, pool)
    for block in ragged_chunks([400, 400]):
        cache.append(block)
    cache.seal()
    kept = next(cache.batches(800))  # in order: views of the joined columns
    before = kept.inputs["features"].copy()
    cache.close()
    other = BlockCache(str(tmp_path), 1 << 30, pool)
    for block in ragged_chunks([400, 400], seed=1):
        block.inputs["features"][:] = -5
        other.append(block)
    other.seal()
    next(other.batches(800))
    np.testing.assert_array_equal(kept.inputs["features"], before)  # its pages were never handed out
    other.close()


def test_spilling_gives_the_held_chunks_back(tmp_path, pool):
    blocks = list(ragged_chunks([300, 300]))
    budget = sum(_nbytes(column) for column in blocks[0].columns().values()) + MB
    with BlockCache(str(tmp_path), budget, pool) as cache:
        cache.append(blocks[0])
        assert cache.in_memory and pool.free_bytes == 0
        cache.append(blocks[1])  # past the budget: both go to disk
        assert not cache.in_memory and pool.free_bytes >= blocks[0].inputs["features"].nbytes
        cache.seal()
        np.testing.assert_array_equal(replay(cache, None)[2], np.arange(600))


@pytest.mark.parametrize("keep_s", [0.0, 60.0])
def test_the_feed_uses_the_pool_only_when_it_keeps_memory(keep_s):
    import pyarrow as pa

    from sparkdl.data.columns import LabelKind
    from sparkdl.data.feed import FeedOptions, PartitionFeed
    from sparkdl.data.inputs import plan_data
    from sparkdl.data.pool import shared_pool

    x = np.random.default_rng(0).normal(size=(20_000, 64)).astype(np.float32)
    features = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 64).cast(pa.list_(pa.float32()))
    table = pa.table({"features": features, "label": pa.array(np.arange(20_000) % 10)})
    plan = plan_data(
        table.schema, feature_cols=("features",), label_col="label", label_kind=LabelKind.CLASS_INDEX
    )
    options = FeedOptions(
        batch_size=100, shuffle=True, seed=0, rank=0, prefetch_batches=2,
        cache_memory_bytes=64 * MB, cache_memory_keep_s=keep_s,
    )  # fmt: skip
    shared_pool().clear()
    seen = []
    for _ in range(2):
        feed = PartitionFeed(iter(table.to_batches(max_chunksize=5000)), plan, options)
        for epoch in (1, 2):
            batches, _ = feed.epoch(epoch)
            labels = np.concatenate([b.label.numpy() for b in batches])
            assert sorted(labels.tolist()) == sorted((np.arange(20_000) % 10).tolist())
        feed.close()
        seen.append(shared_pool().free_bytes)
    assert (seen[0] > 2 * x.nbytes) == (keep_s > 0) and seen[1] == seen[0]
    shared_pool().configure(keep_s=0, limit_bytes=0)
