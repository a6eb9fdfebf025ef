"""The barrier task on an executor: read the barrier context, run one worker, return
its result row (or its error, as a record).

``train_partition`` is the module-level function handed to ``mapInArrow``. The worker
itself is assembled in :mod:`sparkdl.worker.assembly`, which knows nothing of Spark.

How errors leave a task. An error every rank raised at the same point (bad input, a
non-finite average) ends the task normally with the error's record in the result row:
Spark must not re-run a stage that would fail alike. Any other error fails the task
with a :class:`~sparkdl.errors.WorkerFailed` whose message embeds the record, so that
Spark re-runs the stage (resuming from a checkpoint) and, if every attempt fails, the
driver raises the same error class with the same fields.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from sparkdl.comm.meeting_point import MeetingPoint, gather_at
from sparkdl.comm.rendezvous import AllGather
from sparkdl.errors import ErrorRecord, WorkerFailed
from sparkdl.worker.assembly import Placement, TrainSpec, WorkerResult, run_worker
from sparkdl.worker.probe import ProbeSpec, run_probe

__all__ = ["PROBE_SCHEMA", "RESULT_SCHEMA", "TrainSpec", "WorkerResult", "probe_partition", "train_partition"]

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

PROBE_ARROW_SCHEMA = pa.schema([("probe", pa.string())])
PROBE_SCHEMA = "probe string"


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


def placement_of(ctx: Any, torch_threads: int) -> Placement:
    """Where this barrier task's worker runs, from its ``BarrierTaskContext``."""
    rank = ctx.partitionId()
    infos = ctx.getTaskInfos()
    resources = ctx.resources()
    return Placement(
        rank=rank,
        world_size=len(infos),
        host=infos[rank].address.rsplit(":", 1)[0],
        gpu_addresses=tuple(resources["gpu"].addresses) if "gpu" in resources else (),
        torch_threads=torch_threads or int(ctx.cpus() or 1),
        task_attempt=ctx.taskAttemptId(),
        peers=tuple(info.address for info in infos),
    )


def probe_partition(spec: ProbeSpec, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function of the advisor's probe stage: one JSON row per rank."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    placement = placement_of(ctx, spec.train.config.runtime.torch_threads)
    try:
        figures = run_probe(spec, batches, placement, ctx.allGather)
    except Exception as exc:
        rank = placement.rank
        raise WorkerFailed(
            ErrorRecord.of(exc, rank=rank, partition=rank, attempt=ctx.attemptNumber())
        ) from exc
    yield pa.RecordBatch.from_pydict({"probe": [json.dumps(figures)]}, schema=PROBE_ARROW_SCHEMA)


def gather_for(ctx: Any, meeting: MeetingPoint | None, placement: Placement, timeout_s: float) -> AllGather:
    """How the ranks meet: at the driver's store when the stage opened one (``meeting``),
    else through Spark's barrier ``allGather`` (which polls every second: 1 s more per stage)."""
    if meeting is None:
        return ctx.allGather
    return gather_at(meeting, placement.task_attempt, placement.rank, placement.world_size, timeout_s)


def train_partition(spec: TrainSpec, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function of the barrier training stage."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    placement = placement_of(ctx, spec.config.runtime.torch_threads)
    rank = placement.rank
    try:
        result = run_worker(
            spec,
            batches,
            placement,
            gather_for(ctx, spec.meeting, placement, spec.config.runtime.collective_timeout_s),
        )
    except Exception as exc:
        record = ErrorRecord.of(exc, rank=rank, partition=rank, attempt=ctx.attemptNumber())
        if record.agreed:
            # Every rank stopped together: end the task normally and let the driver raise,
            # rather than fail it and have Spark re-run a stage that would fail alike.
            yield error_batch(record)
            return
        raise WorkerFailed(record) from exc
    yield result_batch(result)
