"""The barrier task of :class:`sparkdl.TorchDistributor` (``local_mode = False``): run this
task's agent (:mod:`sparkdl.worker.distributor_agent`) and return rank 0's value as result
rows (:mod:`sparkdl.spark.returned_rows`), or the record of an error the ranks agreed on
(the user's own exception, a stopped peer; :mod:`sparkdl.spark.barrier_task` decides).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pyarrow as pa

from sparkdl.errors import ErrorRecord
from sparkdl.spark.barrier_task import in_barrier_task
from sparkdl.spark.returned_rows import agreed_row, returned_batches
from sparkdl.worker.distributor_agent import LaunchSpec, run_agent


def launch_partition(spec: LaunchSpec, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function of the distributor's barrier stage."""
    for _ in batches:  # the stage's input is one row per task: nothing to read
        pass
    work = functools.partial(run_agent, spec)
    rank, outcome = in_barrier_task(work, 0, spec.meeting, spec.rendezvous_timeout_s)
    if isinstance(outcome, ErrorRecord):
        yield agreed_row(rank, outcome)
        return
    yield from returned_batches(rank, outcome)
