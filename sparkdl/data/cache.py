"""A per-worker local cache of one partition, so epochs 2+ never re-run the Spark query.

A partition within ``data.cache_memory_mb`` stays in memory (epoch 1 keeps the decoded
chunks, joined into one array per column at the first replay), in buffers the Python worker
reuses from one fit to the next (:mod:`sparkdl.data.pool`); a larger one is appended chunk
by chunk to files on the executor's local disk and memory-mapped afterwards. A replayed
batch is a slice (in order) or one gather (shuffled): no copy through Spark.

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

from sparkdl.data.blocks import Block, Column, Ragged, concat_rows, values_of
from sparkdl.data.pool import BufferPool


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
        values = values_of(first)
        self.dtype, self.tail = values.dtype, values.shape[1:]
        self.values_path = directory / f"c{index}.values"
        self.lengths_path = directory / f"c{index}.lengths"
        self._values = self.values_path.open("wb")
        self._lengths = self.lengths_path.open("wb") if self.ragged else None
        self.mapped: Column | None = None

    def append(self, column: Column) -> None:
        """Write a chunk of the column (of the first chunk's kind: the cache checked it)."""
        values = column.compact().values if isinstance(column, Ragged) else column
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

    A partition of at most ``memory_bytes`` stays in memory: epoch 1 keeps a read-only copy
    of each decoded chunk, and the first replay joins them into one array per column. With a
    ``pool``, the copies and the joined columns live in its buffers, given back when the cache
    closes (the next cache gets pages already mapped); without one, views of Spark's Arrow
    buffers are kept as they are, uncopied. The first chunk past ``memory_bytes`` spills
    every chunk to files on local disk, replayed memory-mapped. Either way a replayed batch
    is a slice or a gather of read-only rows.

    Args:
        parent: directory to create the cache files in (an executor local dir); "" for the
            system temporary directory.
        memory_bytes: the most decoded bytes kept in memory; 0 = always on disk.
        pool: where the in-memory rows live, or None for fresh memory.
    """

    def __init__(self, parent: str = "", memory_bytes: int = 0, pool: BufferPool | None = None) -> None:
        self._parent = parent
        self._memory_bytes = memory_bytes
        self._pool = pool
        self._buffers: list[np.ndarray] = []  # taken from the pool, given back when unread
        self._dir: Path | None = None
        self._files: dict[str, _ColumnFile] = {}
        self._held: list[dict[str, Column]] = []  # in memory until the first spill
        self._held_bytes = 0
        self._first: dict[str, tuple[bool, np.dtype, tuple[int, ...]]] = {}
        self._whole: Block | None = None
        self._rows = 0
        self._sealed = False

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def sealed(self) -> bool:
        return self._sealed

    @property
    def in_memory(self) -> bool:
        """True while no chunk has been spilled to disk."""
        return not self._files

    def append(self, block: Block) -> None:
        """Add a chunk; every chunk must have the columns, dtypes and row shapes of the first."""
        if self._sealed:
            raise RuntimeError("cache is sealed; append only during the first epoch")
        columns = block.columns()
        self._check(columns)
        self._rows += len(block)
        size = sum(_nbytes(c) for c in columns.values())
        if self.in_memory and self._held_bytes + size <= self._memory_bytes:
            self._held.append({key: self._keep(column) for key, column in columns.items()})
            self._held_bytes += size
            return
        if self.in_memory:  # the partition is larger than memory_bytes: everything to disk
            self._spill_held(columns)
        for key, column in columns.items():
            self._files[key].append(column)

    def _check(self, columns: dict[str, Column]) -> None:
        kinds = {key: _kind(column) for key, column in columns.items()}
        if not self._first:
            self._first = kinds
            return
        if kinds.keys() != self._first.keys():
            first = sorted(self._first)
            raise ValueError(f"chunk columns {sorted(kinds)} differ from the first chunk's {first}")
        for key, kind in kinds.items():
            if kind != self._first[key]:
                raise ValueError(
                    f"column {key!r}: chunk of {kind[1]} {kind[2]} differs from the first chunk's "
                    f"{self._first[key][1]} {self._first[key][2]}"
                )

    def _spill_held(self, first: dict[str, Column]) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="sparkdl-cache-", dir=self._parent or None))
        self._files = {key: _ColumnFile(self._dir, i, c) for i, (key, c) in enumerate(first.items())}
        self._write(self._held)
        self._held, self._held_bytes = [], 0
        self._give_back()  # the written chunks' memory (the loop's names went with _write)

    def _write(self, held: list[dict[str, Column]]) -> None:
        for columns in held:
            for key, column in columns.items():
                self._files[key].append(column)

    def seal(self) -> None:
        """Finish writing and memory-map the files for replay (in memory: nothing to do)."""
        for file in self._files.values():
            file.seal(self._rows)
        self._sealed = True

    def batches(self, batch_size: int, order: np.ndarray | None = None) -> Iterator[Block]:
        """Replay the rows in batches: in stored order (zero-copy slices) or in ``order``."""
        if not self._sealed:
            raise RuntimeError("seal() the cache before replaying it")
        whole = self._replayed()
        if whole is None:
            return
        for start in range(0, self._rows, batch_size):
            if order is None:
                yield whole.rows(slice(start, start + batch_size))
            else:
                yield whole.rows(order[start : start + batch_size])

    def _replayed(self) -> Block | None:
        """Every row as one block: the memory-mapped files, or the held chunks joined once
        (read-only, as the map is: a batch the model changes in place is a copy)."""
        if self._files:
            return Block.from_columns({key: f.mapped for key, f in self._files.items()})  # type: ignore[misc]
        if self._whole is None and self._held:
            held, self._held, self._held_bytes = self._held, [], 0
            joined: dict[str, Column] = {}
            for key in self._first:  # a column at a time: the peak is the rows and one column
                allocate = self._allocate if self._poolable(self._first[key][1]) else None
                parts = [columns.pop(key) for columns in held]
                joined[key] = parts[0] if len(parts) == 1 else _read_only(concat_rows(parts, allocate))
                del parts
                self._give_back()  # this column's chunks (its joined buffers are still read)
            self._whole = Block.from_columns(joined)
        return self._whole

    def _keep(self, column: Column) -> Column:
        """``column`` as the memory cache keeps it: a read-only copy in pooled memory, or
        without a pool, see :func:`_kept`."""
        if not self._poolable(values_of(column).dtype):
            return _kept(column)
        if isinstance(column, Ragged):
            column = column.compact()
            return Ragged(self._copy(column.values), self._copy(column.offsets))
        return self._copy(column)

    def _poolable(self, dtype: np.dtype) -> bool:
        return self._pool is not None and not dtype.hasobject  # object arrays hold references

    def _copy(self, array: np.ndarray) -> np.ndarray:
        out = self._allocate(array.shape, array.dtype)
        out[...] = array
        return _read_only(out)  # type: ignore[return-value]

    def _allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        assert self._pool is not None
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buffer = self._pool.take(nbytes)
        self._buffers.append(buffer)
        return buffer[:nbytes].view(dtype).reshape(shape)

    def _give_back(self) -> None:
        if self._pool is not None:
            self._pool.give(self._buffers)

    def close(self) -> None:
        """Delete the files and drop the rows (their pooled memory back to the pool); safe
        to call twice."""
        for file in self._files.values():
            file.close()
        self._held, self._whole = [], None
        self._give_back()
        self._buffers = []  # still read somewhere: freed with their last reader
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> BlockCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kept(column: Column) -> Column:
    """``column`` as the memory cache may keep it: in memory no one writes to. A zero-copy
    view of Spark's Arrow buffers is read-only already; any other array is copied (the feed
    hands it to training too, where a model may change its input in place, and a
    transform_fn may reuse it for its next chunk) and the copy made read-only."""
    if not values_of(column).flags.writeable:
        return column
    if isinstance(column, Ragged):
        return _read_only(Ragged(column.values.copy(), column.offsets.copy()))
    return _read_only(column.copy())


def _read_only(column: Column) -> Column:
    values_of(column).flags.writeable = False
    return column


def _nbytes(column: Column) -> int:
    return column.values.nbytes + column.offsets.nbytes if isinstance(column, Ragged) else column.nbytes


def _kind(column: Column) -> tuple[bool, np.dtype, tuple[int, ...]]:
    """What every chunk of a column must share: raggedness, dtype and row shape."""
    values = values_of(column)
    return isinstance(column, Ragged), values.dtype, values.shape[1:]


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
