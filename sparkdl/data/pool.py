"""Host memory that a worker process reuses from one task to the next: the epoch cache's.

The kernel hands a process fresh pages zeroed, at their first touch. On the 2-core VM the
benchmarks run on that costs 0.8 s of system time a GB: 0.1 s for the 128 MB a worker holds
of a 500,000-row partition, against 0.01 s to copy the same bytes into pages it already has.
A fit whose cache kept Spark's own Arrow buffers paid it in every epoch 1, since the Python
worker handed those buffers back to the kernel when the cache closed; the stream it read
competed with Spark's JVM for the same cores, so the feed ran at 0.73 of a bare pass.

Spark runs task after task in one Python worker (``spark.python.worker.reuse``, the
default), so the in-memory epoch cache copies its rows into buffers taken from this
process's pool and gives them back when it closes: the next fit's cache of a similar size
(a tuning loop, a re-run, the next benchmark pass) gets the same pages, already mapped.

Rules that keep it safe and small:

* a buffer goes back only when nothing else holds it (no view, no tensor, no frame): the
  pool never hands out memory that someone can still read;
* free buffers are bounded in bytes (the oldest go first) and all go back to the kernel
  after ``keep_s`` seconds unused, from one daemon thread;
* buffers under :data:`MIN_POOLED` are not worth it and are plain allocations.

Pure numpy and threading: no Spark, no torch.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

GRANULE = 64 << 10  # sizes round up to this, so that chunks of almost equal size share buffers
MIN_POOLED = GRANULE


def _rounded(nbytes: int) -> int:
    return -(-nbytes // GRANULE) * GRANULE


class BufferPool:
    """Free byte buffers, reused by exact (rounded) size.

    Args:
        keep_s: seconds a free buffer may wait unused before the pool hands every free
            buffer back to the kernel; 0 = keep nothing.
        limit_bytes: the most free bytes held; giving more drops the oldest first.
    """

    def __init__(self, keep_s: float, limit_bytes: int) -> None:
        self._lock = threading.Condition()
        self._free: list[np.ndarray] = []  # oldest first
        self._free_bytes = 0
        self._last_used = time.monotonic()
        self._releaser: threading.Thread | None = None
        self.keep_s = keep_s
        self.limit_bytes = limit_bytes

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def configure(self, keep_s: float, limit_bytes: int) -> None:
        """Apply the latest caller's settings (a worker's fits may set them differently)."""
        with self._lock:
            self.keep_s, self.limit_bytes = keep_s, limit_bytes
            self._trim(self.limit_bytes if keep_s > 0 else 0)
        self._wake_releaser()

    def take(self, nbytes: int) -> np.ndarray:
        """A writeable uint8 buffer of at least ``nbytes`` (rounded up to :data:`GRANULE`
        when pooled): a free one of that size if the pool has it, else a new one."""
        if nbytes < MIN_POOLED:
            return np.empty(nbytes, dtype=np.uint8)
        size = _rounded(nbytes)
        with self._lock:
            self._last_used = time.monotonic()
            for i in range(len(self._free) - 1, -1, -1):  # the most recently given first
                if len(self._free[i]) == size:
                    self._free_bytes -= size
                    return self._free.pop(i)
        return np.empty(size, dtype=np.uint8)

    def give(self, buffers: list[np.ndarray]) -> None:
        """Take back every buffer of ``buffers`` that nothing else references any more;
        the others stay in the list (a view or a tensor still reads them: give them again
        later, or drop them). Buffers this pool would not have handed out are dropped."""
        still_read: list[np.ndarray] = []
        with self._lock:
            while buffers:
                buffer = buffers.pop()
                # references: `buffer` and getrefcount's argument; any view or tensor of it
                # holds one more (a numpy view keeps its owning array as `.base`)
                if sys.getrefcount(buffer) > 2:
                    still_read.append(buffer)
                    continue
                if self.keep_s <= 0 or len(buffer) < MIN_POOLED or len(buffer) % GRANULE:
                    continue
                if buffer.base is not None or not buffer.flags.writeable:
                    continue
                self._free.append(buffer)
                self._free_bytes += len(buffer)
            buffers.extend(still_read)
            self._trim(self.limit_bytes)
            self._last_used = time.monotonic()
            if self._free and self._releaser is None:
                self._releaser = threading.Thread(
                    target=self._release_when_idle, name="sparkdl-pool", daemon=True
                )
                self._releaser.start()

    def clear(self) -> None:
        """Hand every free buffer back to the kernel now."""
        with self._lock:
            self._trim(0)
        self._wake_releaser()

    def _wake_releaser(self) -> None:
        """Let the releaser see the new settings; with nothing left to release it ends, and
        this waits for it (bounded), so that no thread outlives the memory it watched."""
        with self._lock:
            self._lock.notify_all()
            releaser = self._releaser if not self._free else None
        if releaser is not None:
            releaser.join(timeout=5.0)

    def _trim(self, limit: int) -> None:
        while self._free and self._free_bytes > limit:
            self._free_bytes -= len(self._free.pop(0))

    def _release_when_idle(self) -> None:
        with self._lock:
            while self._free:
                idle = time.monotonic() - self._last_used
                if idle >= self.keep_s:
                    self._trim(0)
                    break
                self._lock.wait(min(self.keep_s - idle, 3600.0))  # re-checked on waking
            self._releaser = None


_SHARED = BufferPool(keep_s=0.0, limit_bytes=0)


def shared_pool() -> BufferPool:
    """This process's pool (it keeps nothing until a caller configures it)."""
    return _SHARED
