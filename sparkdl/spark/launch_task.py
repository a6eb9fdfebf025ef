"""The barrier task of :class:`sparkdl.TorchDistributor` (``local_mode = False``): read
the barrier context, run this task's agent (:mod:`sparkdl.worker.torchrun`), and return
rank 0's value as result rows, or the failure as a record.

Rank 0's value comes back in chunks of one binary column (Spark Connect caps a result
batch; 1 MB rows pass everywhere). A state dict is not among them when the driver's
weights server took it. An error the ranks agree on (the user's own exception, a stopped
peer) ends the task normally with its record; any other fails the task, so that Spark
re-runs the stage.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import pyarrow as pa
import torch

from sparkdl.errors import ErrorRecord, WorkerFailed
from sparkdl.spark.task import gather_for, placement_of
from sparkdl.worker.torchrun import LaunchSpec, Returned, run_agent

LAUNCH_ARROW_SCHEMA = pa.schema(
    [
        ("rank", pa.int32()),
        ("seq", pa.int32()),
        ("kind", pa.string()),  # "pickle", "tensors", "uploaded" or "none"
        ("chunk", pa.binary()),
        ("error", pa.string()),
    ]
)
LAUNCH_SCHEMA = "rank int, seq int, kind string, chunk binary, error string"

#: Bytes of the returned value per result row.
CHUNK_BYTES = 1 << 20


def returned_batches(rank: int, returned: Returned) -> Iterator[pa.RecordBatch]:
    """Result rows of one rank: rank 0's value in chunks (one empty row for the others)."""
    if returned.uploaded:
        kind, data = "uploaded", b""
    elif returned.state_dict is not None:  # no weights server (Spark Connect): in the rows
        buffer = io.BytesIO()
        torch.save(returned.state_dict, buffer)
        kind, data = "tensors", buffer.getvalue()
    elif returned.pickled:
        kind, data = "pickle", returned.pickled
    else:
        kind, data = "none", b""
    chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    for start in range(0, len(chunks), 16):
        part = chunks[start : start + 16]
        yield pa.RecordBatch.from_pydict(
            {
                "rank": [rank] * len(part),
                "seq": list(range(start, start + len(part))),
                "kind": [kind] * len(part),
                "chunk": part,
                "error": [""] * len(part),
            },
            schema=LAUNCH_ARROW_SCHEMA,
        )


def launch_partition(spec: LaunchSpec, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function of the distributor's barrier stage."""
    from pyspark import BarrierTaskContext

    for _ in batches:  # the stage's input is one row per task: nothing to read
        pass
    ctx = BarrierTaskContext.get()
    place = placement_of(ctx, 0)
    try:
        returned = run_agent(
            spec,
            place,
            gather_for(ctx, spec.meeting, place, spec.rendezvous_timeout_s),
        )
    except Exception as exc:
        record = ErrorRecord.of(exc, rank=place.rank, partition=place.rank, attempt=ctx.attemptNumber())
        if record.agreed:
            yield pa.RecordBatch.from_pydict(
                {
                    "rank": [place.rank],
                    "seq": [0],
                    "kind": ["none"],
                    "chunk": [b""],
                    "error": [record.to_json()],
                },
                schema=LAUNCH_ARROW_SCHEMA,
            )
            return
        raise WorkerFailed(record) from exc
    yield from returned_batches(place.rank, returned)
