"""The epoch cache's pages outlive a Spark task in its Python worker, for the next task's
cache: what data.cache_memory_keep_s relies on (Spark reuses Python workers, barrier
stages included)."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pyarrow as pa
import pytest

pytestmark = pytest.mark.spark

ROWS, WIDTH = 60_000, 64


def feed_twice_over(keep_s: float, batches):
    """Run the partition through a PartitionFeed (two epochs), as fit's workers do; report
    this Python worker's pid and where the cache's joined features lay."""
    from sparkdl.data.columns import LabelKind
    from sparkdl.data.feed import FeedOptions, PartitionFeed
    from sparkdl.data.inputs import plan_data
    from sparkdl.data.pool import shared_pool

    first = next(batches)
    plan = plan_data(
        first.schema, feature_cols=("features",), label_col="label", label_kind=LabelKind.CLASS_INDEX
    )
    options = FeedOptions(
        batch_size=64, shuffle=True, seed=0, rank=0, prefetch_batches=2,
        cache_memory_bytes=64 << 20, cache_memory_keep_s=keep_s,
    )  # fmt: skip
    feed = PartitionFeed(itertools.chain([first], batches), plan, options)
    rows = 0
    for epoch in (1, 2):
        tensors, _ = feed.epoch(epoch)
        rows += sum(len(batch) for batch in tensors)
    # the joined column the replays read (the cache's own, private view of it)
    joined = feed._cache._replayed().inputs["features"]  # type: ignore[union-attr]
    where, joined = joined.__array_interface__["data"][0], None
    feed.close()
    free = shared_pool().free_bytes
    if keep_s == 0:
        shared_pool().clear()  # leave the workers as they were
    yield pa.RecordBatch.from_pydict(
        {"pid": [os.getpid()], "rows": [rows], "joined_at": [where], "free": [free]}
    )


def test_the_next_barrier_task_in_a_python_worker_reuses_the_last_caches_pages(spark):
    import functools

    x = np.random.default_rng(0).normal(size=(ROWS, WIDTH)).astype(np.float32)
    features = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), WIDTH)
    table = pa.table({"features": features.cast(pa.list_(pa.float32())), "label": np.arange(ROWS) % 10})
    df = spark.createDataFrame(table).repartition(2).cache()
    assert df.count() == ROWS
    schema = "pid long, rows long, joined_at long, free long"

    def job(keep_s):
        stage = df.mapInArrow(functools.partial(feed_twice_over, keep_s), schema, barrier=True)
        return stage.repartition(1).collect()

    last: dict[int, object] = {}  # pid -> the latest task that ran in it
    again = 0
    try:
        for _ in range(6):  # idle Python workers are handed out oldest first: pids come round again
            tasks = job(60.0)
            assert sum(task.rows for task in tasks) == 2 * ROWS  # two epochs of every row
            for task in tasks:
                assert task.free >= 2 * (ROWS // 4) * WIDTH * 4  # its chunks and their join, kept
                if task.pid in last:  # the same Python worker: its cache sat in the last one's pages
                    assert task.joined_at == last[task.pid].joined_at  # type: ignore[attr-defined]
                    again += 1
                last[task.pid] = task
            if again >= 2:
                break
        assert again, f"no Python worker ran two of the tasks: {sorted(last)}"
    finally:
        job(0.0)  # empties the pools
