"""Rank 0's returned value as result rows, and back: shared by ``sparkdl.run``'s stage
(:mod:`sparkdl.spark.own_loop_task`) and the TorchDistributor's
(:mod:`sparkdl.spark.distributor_task`).

Rank 0's value comes back in chunks of one binary column (Spark Connect caps a result
batch; 1 MB rows pass everywhere). A state dict is not among them when the driver's
weights server took it. An error the ranks agreed on is one row with its record.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import torch

from sparkdl.errors import ErrorRecord
from sparkdl.spark.stage import raise_agreed_error
from sparkdl.worker.returned import Returned

RETURNED_ARROW_SCHEMA = pa.schema(
    [
        ("rank", pa.int32()),
        ("seq", pa.int32()),
        ("kind", pa.string()),  # "pickle", "tensors", "uploaded", "none", or a stage's own kind
        ("chunk", pa.binary()),
        ("error", pa.string()),
    ]
)
RETURNED_SCHEMA = "rank int, seq int, kind string, chunk binary, error string"

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
            schema=RETURNED_ARROW_SCHEMA,
        )


def single_row(rank: int, kind: str, chunk: bytes = b"", error: str = "") -> pa.RecordBatch:
    """One result row of ``rank``: a stage's own ``kind`` of row, or an error's."""
    return pa.RecordBatch.from_pydict(
        {"rank": [rank], "seq": [0], "kind": [kind], "chunk": [chunk], "error": [error]},
        schema=RETURNED_ARROW_SCHEMA,
    )


def agreed_row(rank: int, record: ErrorRecord) -> pa.RecordBatch:
    """``rank``'s row of an error every rank agreed on (the driver raises it)."""
    return single_row(rank, "none", b"", record.to_json())


def rank0_value(rows: list[Any], uploaded: dict[str, torch.Tensor] | None) -> Any:
    """Rank 0's return value from the stage's rows (and the weights server's upload).

    Raises:
        SparkDLError: the error the ranks agreed on (the failing rank's, not its peers').
    """
    raise_agreed_error(rows)
    lead = sorted((row for row in rows if row["rank"] == 0 and row["kind"] != "meta"), key=lambda r: r["seq"])
    kind = lead[0]["kind"] if lead else "none"
    data = b"".join(bytes(row["chunk"]) for row in lead)
    if kind == "uploaded":
        return uploaded
    if kind == "tensors":
        return torch.load(io.BytesIO(data), weights_only=True)
    if kind == "pickle":
        return unpickled(data)
    return None


def unpickled(data: bytes) -> Any:
    """A cloudpickled returned value (None for none)."""
    if not data:
        return None
    import cloudpickle

    return cloudpickle.loads(data)
