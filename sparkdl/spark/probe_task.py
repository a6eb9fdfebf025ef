"""The advisor's probe on an executor: time every candidate layout on this worker's first
rows (:mod:`sparkdl.worker.probe`) and return its figures as one JSON row."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator

import pyarrow as pa

from sparkdl.errors import ErrorRecord, WorkerFailed
from sparkdl.spark.barrier_task import in_barrier_task
from sparkdl.worker.probe import ProbeSpec, run_probe

PROBE_ARROW_SCHEMA = pa.schema([("probe", pa.string())])
PROBE_SCHEMA = "probe string"


def probe_partition(spec: ProbeSpec, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function of the advisor's probe stage: one JSON row per rank. A
    probe has no row for an error: even one every rank agreed on fails the task."""
    work = functools.partial(run_probe, spec, batches)
    _, figures = in_barrier_task(work, spec.train.config.runtime.torch_threads, None, 0.0)
    if isinstance(figures, ErrorRecord):
        raise WorkerFailed(figures)
    yield pa.RecordBatch.from_pydict({"probe": [json.dumps(figures)]}, schema=PROBE_ARROW_SCHEMA)
