"""The barrier task of ``sparkdl.run``: run one worker of the user's own loop
(:mod:`sparkdl.worker.own_loop`), return rank 0's value and history.

The result rows are the returned value's (:mod:`sparkdl.spark.returned_rows`), plus one
``meta`` row per rank: its history (rank 0's) and where it ran, as JSON. An error the
ranks agree on ends the task normally with its record; any other fails it, so that Spark
re-runs the stage (and the loop resumes from ``ctx.load_checkpoint``):
:mod:`sparkdl.spark.barrier_task` decides.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator

import pyarrow as pa

from sparkdl.errors import ErrorRecord
from sparkdl.spark.barrier_task import in_barrier_task
from sparkdl.spark.returned_rows import agreed_row, returned_batches, single_row
from sparkdl.worker.own_loop import LoopSpec, run_own_loop

#: The ``kind`` of the row carrying a rank's history and device.
META = "meta"


def own_loop_partition(spec: LoopSpec, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function of ``sparkdl.run``'s barrier stage."""
    runtime = spec.config.runtime
    work = functools.partial(run_own_loop, spec, batches if spec.plan is not None else iter(()))
    rank, result = in_barrier_task(work, runtime.torch_threads, spec.meeting, runtime.collective_timeout_s)
    if isinstance(result, ErrorRecord):
        yield agreed_row(rank, result)
        return
    meta = json.dumps({"history": result.history, "device": result.device}).encode()
    yield single_row(rank, META, meta)
    yield from returned_batches(rank, result.returned)
