"""How many lines a worker may put in the driver's log: a burst, then a steady rate, per rank.

Why. A worker's log records (the progress channel's LOG frames) and its reasons for stopping
(the parameter server's ABORT frames) are logged again on the driver, each escaped to one
line and cut to a few thousand characters; but nothing bounded how many there were, and one
holder of the fit's secret wrote 100 MB of the driver's log in 2 s. Now each rank has a token
bucket: :data:`BURST` lines at once, then :data:`PER_S` a second. The lines over it are
dropped and counted, and the count is said in one line when that rank's next line gets
through, at most every :data:`SAY_EVERY_S` (a flood that goes on is one count a rank and
half-minute), and when the server stops (:meth:`WorkerLines.flush`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Lines a rank may log at once: a worker's start (its held warnings, a traceback's lines) fits.
BURST = 200
#: Lines a rank may log a second once its burst is spent (at most 8,000 characters each).
PER_S = 20.0
#: How often the count of a rank's dropped lines is said while they go on being dropped.
SAY_EVERY_S = 30.0


@dataclass
class _Bucket:
    tokens: float
    at: float  # the clock when ``tokens`` was counted
    dropped: int = 0  # lines dropped and not said yet
    said_at: float = -math.inf  # the clock when that count was last said


class WorkerLines:
    """A token bucket per rank for one kind of line a worker has the driver log.

    Args:
        ranks: the fit's workers; a line of any other rank (a HELLO may claim one) counts
            against one bucket shared by them all, so the buckets stay as many as the ranks.
        logger: where the dropped lines are counted.
        what: what the lines are, for that count ("log records").
        burst, per_s: the bucket's size and how fast it refills.
        clock: monotonic clock (patched in tests).
    """

    def __init__(
        self,
        ranks: int,
        logger: logging.Logger,
        what: str,
        burst: int = BURST,
        per_s: float = PER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ranks = ranks
        self._log = logger
        self._what = what
        self._burst = burst
        self._per_s = per_s
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[int, _Bucket] = {}

    def admit(self, rank: int) -> bool:
        """Whether a line of ``rank`` may be logged now (False: it is dropped and counted). The
        count of that rank's lines dropped before it is logged first, at most every
        :data:`SAY_EVERY_S`."""
        key = rank if 0 <= rank < self._ranks else -1
        now = self._clock()
        with self._lock:
            bucket = self._buckets.setdefault(key, _Bucket(float(self._burst), now))
            bucket.tokens = min(float(self._burst), bucket.tokens + (now - bucket.at) * self._per_s)
            bucket.at = now
            if bucket.tokens < 1:
                bucket.dropped += 1
                return False
            bucket.tokens -= 1
            dropped = 0
            if bucket.dropped and now - bucket.said_at >= SAY_EVERY_S:
                dropped, bucket.dropped, bucket.said_at = bucket.dropped, 0, now
        if dropped:
            self._say(key, dropped)
        return True

    def flush(self) -> None:
        """Log the counts of dropped lines not said yet (when the server stops)."""
        with self._lock:
            counts = {key: bucket.dropped for key, bucket in self._buckets.items() if bucket.dropped}
            for key in counts:
                self._buckets[key].dropped = 0
        for key, dropped in sorted(counts.items()):
            self._say(key, dropped)

    def _say(self, key: int, dropped: int) -> None:
        who = f"rank {key}" if key >= 0 else f"ranks outside the fit's {self._ranks}"
        self._log.warning(
            "[%s] %d %s dropped: a rank may log %d at once, then %g a second",
            who,
            dropped,
            self._what,
            self._burst,
            self._per_s,
        )
