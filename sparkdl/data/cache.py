"""A per-worker local cache of one partition, so epochs 2+ never re-run the Spark query.

Epoch 1 appends every chunk to files on the executor's local disk; afterwards they are
memory-mapped, so a replayed batch is a slice (in order) or one gather (shuffled) of the
page cache: no copy through Spark, and nothing held twice in memory.

Two forms, one interface:

* :class:`BlockCache` holds the decoded rows, one raw file per column (a sequence as
  its values and its row lengths): replay decodes nothing.
* :class:`ArrowCache` holds the raw record batches (an Arrow IPC file) and decodes each
  replayed batch again, for a ``transform_fn`` that must run every epoch (random
  augmentation).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa

from sparkdl.data.blocks import Block, Column, Ragged


class EpochCache(Protocol):
    @property
    def rows(self) -> int: ...

    @property
    def sealed(self) -> bool: ...

    def seal(self) -> None: ...

    def batches(self, batch_size: int, order: np.ndarray | None = None) -> Iterator[Block]: ...

    def close(self) -> None: ...


class _ColumnFile:
    """One column's rows on disk: a fixed-shape array, or a sequence (values + lengths)."""

    def __init__(self, directory: Path, index: int, first: Column) -> None:
        self.ragged = isinstance(first, Ragged)
        values = first.values if isinstance(first, Ragged) else first
        self.dtype, self.tail = values.dtype, values.shape[1:]
        self.values_path = directory / f"c{index}.values"
        self.lengths_path = directory / f"c{index}.lengths"
        self._values = self.values_path.open("wb")
        self._lengths = self.lengths_path.open("wb") if self.ragged else None
        self.mapped: Column | None = None

    def append(self, column: Column, key: str) -> None:
        values = column.compact().values if isinstance(column, Ragged) else column
        if (
            isinstance(column, Ragged) != self.ragged
            or values.dtype != self.dtype
            or values.shape[1:] != self.tail
        ):
            raise ValueError(
                f"column {key!r}: chunk of {values.dtype} {values.shape[1:]} differs from the first "
                f"chunk's {self.dtype} {self.tail}"
            )
        np.ascontiguousarray(values).tofile(self._values)
        if self._lengths is not None and isinstance(column, Ragged):
            column.lengths.astype(np.int64).tofile(self._lengths)

    def seal(self, rows: int) -> None:
        self._values.close()
        if self._lengths is not None:
            self._lengths.close()
        if self.ragged:
            lengths = np.fromfile(self.lengths_path, dtype=np.int64)
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            self.mapped = Ragged(self._map(int(offsets[-1])), offsets)
        else:
            self.mapped = self._map(rows)

    def _map(self, count: int) -> np.ndarray:
        if count == 0 or self.dtype.itemsize * int(np.prod(self.tail)) == 0:
            return np.zeros((count, *self.tail), dtype=self.dtype)
        return np.memmap(self.values_path, dtype=self.dtype, mode="r", shape=(count, *self.tail))

    def close(self) -> None:
        for fh in (self._values, self._lengths):
            if fh is not None and not fh.closed:
                fh.close()
        self.mapped = None


class BlockCache:
    """Write-once, read-many store of one worker's decoded rows.

    Args:
        parent: directory to create the cache in (an executor local dir); "" for the
            system temporary directory.
    """

    def __init__(self, parent: str = "") -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="sparkdl-cache-", dir=parent or None))
        self._files: dict[str, _ColumnFile] = {}
        self._rows = 0
        self._sealed = False

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def sealed(self) -> bool:
        return self._sealed

    def append(self, block: Block) -> None:
        """Add a chunk; every chunk must have the columns, dtypes and row shapes of the first."""
        if self._sealed:
            raise RuntimeError("cache is sealed; append only during the first epoch")
        columns = block.columns()
        if not self._files:
            self._files = {key: _ColumnFile(self._dir, i, c) for i, (key, c) in enumerate(columns.items())}
        elif columns.keys() != self._files.keys():
            raise ValueError(
                f"chunk columns {sorted(columns)} differ from the first chunk's {sorted(self._files)}"
            )
        for key, column in columns.items():
            self._files[key].append(column, key)
        self._rows += len(block)

    def seal(self) -> None:
        """Finish writing and memory-map the files for replay."""
        for file in self._files.values():
            file.seal(self._rows)
        self._sealed = True

    def batches(self, batch_size: int, order: np.ndarray | None = None) -> Iterator[Block]:
        """Replay the rows in batches: in stored order (zero-copy slices) or in ``order``."""
        if not self._sealed:
            raise RuntimeError("seal() the cache before replaying it")
        if not self._files:
            return
        whole = Block.from_columns({key: f.mapped for key, f in self._files.items()})  # type: ignore[misc]
        for start in range(0, self._rows, batch_size):
            if order is None:
                yield whole.rows(slice(start, start + batch_size))
            else:
                yield whole.rows(order[start : start + batch_size])

    def close(self) -> None:
        """Delete the files; safe to call twice."""
        for file in self._files.values():
            file.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> BlockCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ArrowCache:
    """Write-once, read-many store of one worker's raw record batches; each replayed batch
    is decoded again by ``decode`` (which runs transform_fn).

    Args:
        decode: record batch -> block, as the first epoch decodes.
        parent: as for :class:`BlockCache`.
    """

    def __init__(self, decode: Callable[[pa.RecordBatch], Block], parent: str = "") -> None:
        self._decode = decode
        self._dir = Path(tempfile.mkdtemp(prefix="sparkdl-cache-", dir=parent or None))
        self._path = self._dir / "rows.arrow"
        self._writer: pa.ipc.RecordBatchFileWriter | None = None
        self._rows = 0
        self._table: pa.Table | None = None
        self._chunks: list[pa.RecordBatch] = []
        self._starts = np.zeros(1, dtype=np.int64)
        self._source: pa.MemoryMappedFile | None = None

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def sealed(self) -> bool:
        return self._table is not None

    def append(self, batch: pa.RecordBatch) -> None:
        if self.sealed:
            raise RuntimeError("cache is sealed; append only during the first epoch")
        if self._writer is None:
            self._writer = pa.ipc.new_file(str(self._path), batch.schema)
        self._writer.write_batch(batch)
        self._rows += batch.num_rows

    def seal(self) -> None:
        if self._writer is None:
            self._table = pa.table({})
            return
        self._writer.close()
        self._source = pa.memory_map(str(self._path), "r")
        self._table = pa.ipc.open_file(self._source).read_all()
        self._chunks = self._table.to_batches()
        self._starts = np.cumsum([0, *(len(chunk) for chunk in self._chunks)])

    def batches(self, batch_size: int, order: np.ndarray | None = None) -> Iterator[Block]:
        if self._table is None:
            raise RuntimeError("seal() the cache before replaying it")
        for start in range(0, self._rows, batch_size):
            if order is None:
                rows = self._table.slice(start, batch_size)
            else:
                rows = self._take(order[start : start + batch_size])
            yield self._decode(rows.combine_chunks().to_batches()[0])

    def _take(self, index: np.ndarray) -> pa.Table:
        """Rows ``index`` in that order, gathered chunk by chunk: ``Table.take`` would first
        concatenate every chunk, copying the whole partition for each batch."""
        chunk = np.searchsorted(self._starts, index, side="right") - 1
        grouped = np.argsort(chunk, kind="stable")
        groups = np.split(grouped, np.flatnonzero(np.diff(chunk[grouped])) + 1)
        parts = [
            self._chunks[chunk[g[0]]].take(pa.array(index[g] - self._starts[chunk[g[0]]])) for g in groups
        ]
        return pa.Table.from_batches(parts).combine_chunks().take(pa.array(np.argsort(grouped)))

    def close(self) -> None:
        if self._writer is not None and self._table is None:
            self._writer.close()
        self._table = None
        self._chunks = []
        if self._source is not None:
            self._source.close()
            self._source = None
        shutil.rmtree(self._dir, ignore_errors=True)
