"""fit's barrier task on an executor: run one worker, return its result row (or the
record of an error every rank agreed on: :mod:`sparkdl.spark.barrier_task` decides).

``train_partition`` is the module-level function handed to ``mapInArrow``. The worker
itself is assembled in :mod:`sparkdl.worker.assembly`, which knows nothing of Spark.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from sparkdl.errors import ErrorRecord
from sparkdl.spark.barrier_task import in_barrier_task
from sparkdl.worker.assembly import TrainSpec, WorkerResult, run_worker

__all__ = ["RESULT_SCHEMA", "TrainSpec", "WorkerResult", "train_partition"]

RESULT_ARROW_SCHEMA = pa.schema(
    [
        ("rank", pa.int32()),
        ("rows", pa.int64()),
        ("bad_rows", pa.int64()),
        ("history", pa.string()),
        ("state", pa.binary()),
        ("input_shapes", pa.string()),
        ("output_shape", pa.string()),
        ("device", pa.string()),
        ("error", pa.string()),  # an ErrorRecord as JSON when every rank stopped together
    ]
)
RESULT_SCHEMA = (
    "rank int, rows long, bad_rows long, history string, state binary, input_shapes string, "
    "output_shape string, device string, error string"
)


def result_batch(result: WorkerResult) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {
            "rank": [result.rank],
            "rows": [result.rows],
            "bad_rows": [result.bad_rows],
            "history": [json.dumps(result.history)],
            "state": [result.state],
            "input_shapes": [json.dumps({k: list(v) for k, v in result.input_shapes.items()})],
            "output_shape": [json.dumps(list(result.output_shape))],
            "device": [json.dumps(result.device)],
            "error": [""],
        },
        schema=RESULT_ARROW_SCHEMA,
    )


def error_batch(record: ErrorRecord) -> pa.RecordBatch:
    columns: dict[str, list[Any]] = {name: [None] for name in RESULT_ARROW_SCHEMA.names}
    columns.update(rank=[record.rank], rows=[0], bad_rows=[0], error=[record.to_json()])
    return pa.RecordBatch.from_pydict(columns, schema=RESULT_ARROW_SCHEMA)


def train_partition(spec: TrainSpec, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function of the barrier training stage."""
    runtime = spec.config.runtime
    work = functools.partial(run_worker, spec, batches)
    _, outcome = in_barrier_task(work, runtime.torch_threads, spec.meeting, runtime.collective_timeout_s)
    yield error_batch(outcome) if isinstance(outcome, ErrorRecord) else result_batch(outcome)
