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
* free buffers are bounded in bytes (the oldest go first), and each goes back to the
  kernel ``keep_s`` seconds after it was given back unless taken again (one daemon thread
  watches them; it ends when none is left);
* buffers under :data:`MIN_POOLED` are not worth it and are plain allocations.

Pure numpy and threading: no Spark, no torch.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque

import numpy as np

from sparkdl import process

GRANULE = 64 << 10  # sizes round up to this, so that chunks of almost equal size share buffers
MIN_POOLED = GRANULE


def _rounded(nbytes: int) -> int:
    return -(-nbytes // GRANULE) * GRANULE


def _unshared_refcount() -> int:
    """What ``sys.getrefcount`` says of a local that nothing else references, measured the
    way :meth:`BufferPool.give` reads its buffers (an interpreter may borrow references to
    locals, as CPython 3.14 does, and count one fewer)."""
    probes = [np.empty(0, dtype=np.uint8)]
    probe = probes.pop()
    return sys.getrefcount(probe)


_UNSHARED = _unshared_refcount()


class BufferPool:
    """Free byte buffers, reused by exact (rounded) size.

    Args:
        keep_s: seconds a free buffer waits to be taken again before it goes back to the
            kernel; 0 = keep nothing.
        limit_bytes: the most free bytes held; giving more drops the oldest first.
    """

    def __init__(self, keep_s: float, limit_bytes: int) -> None:
        self._lock = threading.Condition()
        # size -> (when given back, buffer), oldest first; a size here has a free buffer
        self._free: dict[int, deque[tuple[float, np.ndarray]]] = {}
        self._free_bytes = 0
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
        when pooled): the most recently given free one of that size, else a new one."""
        if nbytes < MIN_POOLED:
            return np.empty(nbytes, dtype=np.uint8)
        size = _rounded(nbytes)
        with self._lock:
            if size in self._free:
                return self._pop(size, newest=True)
        return np.empty(size, dtype=np.uint8)

    def give(self, buffers: list[np.ndarray]) -> None:
        """Take back every buffer of ``buffers`` that nothing else references any more;
        the others stay in the list (a view or a tensor still reads them: give them again
        later, or drop them). Buffers this pool would not have handed out are dropped."""
        still_read: list[np.ndarray] = []
        now = time.monotonic()
        with self._lock:
            while buffers:
                buffer = buffers.pop()
                # any view, tensor or memoryview of it holds one more reference (a numpy
                # view keeps its owning array as `.base`)
                if sys.getrefcount(buffer) > _UNSHARED:
                    still_read.append(buffer)
                    continue
                size = len(buffer)
                if self.keep_s <= 0 or size < MIN_POOLED or size % GRANULE:
                    continue
                if buffer.base is not None or not buffer.flags.writeable:
                    continue
                self._free.setdefault(size, deque()).append((now, buffer))
                self._free_bytes += size
            buffers.extend(still_read)
            self._trim(self.limit_bytes)
            if self._free_bytes and self._releaser is None:
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
        """Let the releaser see the new settings. With nothing left to watch it ends, and
        this waits for it (bounded), so that no thread outlives the memory it watched; a
        buffer given meanwhile keeps it, rightly, alive."""
        with self._lock:
            self._lock.notify_all()
            releaser = self._releaser
        deadline = time.monotonic() + 5.0
        while releaser is not None and releaser.is_alive() and time.monotonic() < deadline:
            with self._lock:
                if self._free_bytes:
                    return
            releaser.join(0.01)

    def _oldest(self) -> tuple[float, int]:
        """(given at, size) of the free buffer given back longest ago (there is one)."""
        return min((free[0][0], size) for size, free in self._free.items())

    def _trim(self, limit: int) -> None:
        while self._free_bytes > limit:
            self._pop(self._oldest()[1], newest=False)

    def _pop(self, size: int, newest: bool) -> np.ndarray:
        """Remove a free buffer of ``size``: the newest given (to reuse) or the oldest (to drop)."""
        free = self._free[size]
        _, buffer = free.pop() if newest else free.popleft()
        self._free_bytes -= size
        if not free:
            del self._free[size]
        return buffer

    def _release_when_idle(self) -> None:
        with self._lock:
            while self._free_bytes:
                given_at, size = self._oldest()
                wait = given_at + self.keep_s - time.monotonic()
                if wait <= 0:
                    self._pop(size, newest=False)
                    continue
                self._lock.wait(min(wait, 3600.0))  # re-checked on waking
            self._releaser = None


_SHARED = BufferPool(keep_s=0.0, limit_bytes=0)
process.keep(
    "data.pool",
    "executor",
    "the epoch cache's pages, free for the next fit's cache (fresh pages cost the kernel 0.8 s a GB)",
    "data.cache_memory_keep_s (60 s) after the fit that gave them back",
    _SHARED.clear,
)


def shared_pool() -> BufferPool:
    """This process's pool (it keeps nothing until a caller configures it)."""
    return _SHARED
