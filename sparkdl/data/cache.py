"""A per-worker local cache of one partition, so epochs 2+ never re-run the Spark query.

Epoch 1 appends the decoded float32 features and labels to two raw files on the
executor's local disk; afterwards they are memory-mapped, so a replayed batch is a
slice (in order) or one gather (shuffled) of the page cache: no decoding, no copy
through Spark, and nothing held twice in memory.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from sparkdl.data.batching import Arrays


class PartitionCache:
    """Write-once, read-many store of one worker's rows.

    Args:
        parent: directory to create the cache in (an executor local dir); "" for the
            system temporary directory.
    """

    def __init__(self, parent: str = "") -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="sparkdl-cache-", dir=parent or None))
        self._x_file = (self._dir / "x.f32").open("wb")
        self._y_file = (self._dir / "y.bin").open("wb")
        self._rows = 0
        self._x_tail: tuple[int, ...] | None = None
        self._y_tail: tuple[int, ...] | None = None
        self._y_dtype: np.dtype | None = None
        self._x: np.ndarray | None = None
        self._y: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return self._rows

    def widths(self) -> tuple[int, int]:
        """Feature width and label width (1 for a scalar label) of the stored rows."""
        x_width = int(np.prod(self._x_tail)) if self._x_tail else 0
        y_width = int(np.prod(self._y_tail)) if self._y_tail else 1
        return x_width, y_width

    @property
    def sealed(self) -> bool:
        return self._x is not None

    def append(self, x: np.ndarray, y: np.ndarray) -> None:
        """Add a chunk; every chunk must have the shapes and label dtype of the first."""
        if self.sealed:
            raise RuntimeError("cache is sealed; append only during the first epoch")
        if self._x_tail is None:
            self._x_tail, self._y_tail, self._y_dtype = x.shape[1:], y.shape[1:], y.dtype
        elif x.shape[1:] != self._x_tail or y.shape[1:] != self._y_tail or y.dtype != self._y_dtype:
            raise ValueError(
                f"chunk shapes {x.shape[1:]}/{y.shape[1:]} ({y.dtype}) differ from the first "
                f"chunk's {self._x_tail}/{self._y_tail} ({self._y_dtype})"
            )
        np.ascontiguousarray(x, dtype=np.float32).tofile(self._x_file)
        np.ascontiguousarray(y).tofile(self._y_file)
        self._rows += len(x)

    def seal(self) -> None:
        """Finish writing and memory-map the files for replay."""
        self._x_file.close()
        self._y_file.close()
        if self._rows == 0:
            self._x = np.zeros((0, *(self._x_tail or (0,))), dtype=np.float32)
            self._y = np.zeros((0, *(self._y_tail or ())), dtype=self._y_dtype or np.float32)
            return
        x_shape = (self._rows, *(self._x_tail or ()))
        y_shape = (self._rows, *(self._y_tail or ()))
        self._x = np.memmap(self._dir / "x.f32", dtype=np.dtype(np.float32), mode="r", shape=x_shape)
        self._y = np.memmap(self._dir / "y.bin", dtype=np.dtype(self._y_dtype), mode="r", shape=y_shape)

    def batches(self, batch_size: int, order: np.ndarray | None = None) -> Iterator[Arrays]:
        """Replay the rows in batches: in stored order (zero-copy slices) or in ``order``."""
        if self._x is None or self._y is None:
            raise RuntimeError("seal() the cache before replaying it")
        for start in range(0, self._rows, batch_size):
            if order is None:
                yield self._x[start : start + batch_size], self._y[start : start + batch_size]
            else:
                idx = order[start : start + batch_size]
                yield self._x[idx], self._y[idx]

    def close(self) -> None:
        """Delete the files; safe to call twice."""
        if not self._x_file.closed:
            self._x_file.close()
            self._y_file.close()
        self._x = self._y = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> PartitionCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
