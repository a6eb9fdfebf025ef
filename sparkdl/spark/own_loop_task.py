"""The barrier task of ``sparkdl.run``: read the barrier context, run one worker of the
user's own loop (:mod:`sparkdl.worker.own_loop`), return rank 0's value and history.

The result rows are the TorchDistributor's (:mod:`sparkdl.spark.launch_task`), plus one
``meta`` row per rank: its history (rank 0's) and where it ran, as JSON. An error the
ranks agree on ends the task normally with its record; any other fails it, so that Spark
re-runs the stage (and the loop resumes from ``ctx.load_checkpoint``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pyarrow as pa

from sparkdl.errors import ErrorRecord, WorkerFailed
from sparkdl.spark.launch_task import LAUNCH_ARROW_SCHEMA, returned_batches
from sparkdl.spark.task import gather_for, placement_of
from sparkdl.worker.own_loop import LoopSpec, run_own_loop

#: The ``kind`` of the row carrying a rank's history and device.
META = "meta"


def own_loop_partition(spec: LoopSpec, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function of ``sparkdl.run``'s barrier stage."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    placement = placement_of(ctx, spec.config.runtime.torch_threads)
    rank = placement.rank
    gather = gather_for(ctx, spec.meeting, placement, spec.config.runtime.collective_timeout_s)
    try:
        result = run_own_loop(spec, batches if spec.plan is not None else iter(()), placement, gather)
    except Exception as exc:
        record = ErrorRecord.of(exc, rank=rank, partition=rank, attempt=ctx.attemptNumber())
        if record.agreed:
            yield _row(rank, "none", b"", record.to_json())
            return
        raise WorkerFailed(record) from exc
    meta = json.dumps({"history": result.history, "device": result.device}).encode()
    yield _row(rank, META, meta, "")
    yield from returned_batches(rank, result.returned)


def _row(rank: int, kind: str, chunk: bytes, error: str) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {"rank": [rank], "seq": [0], "kind": [kind], "chunk": [chunk], "error": [error]},
        schema=LAUNCH_ARROW_SCHEMA,
    )
