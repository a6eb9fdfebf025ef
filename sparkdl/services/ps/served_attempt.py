"""Which stage attempt the parameter server's shards serve, and the shards' snapshots.

Stage attempts. A HELLO from a newer stage attempt restarts the clocks, so it is only
believed when ``attempt_started`` confirms Spark started that attempt (the driver asks
Spark's status store: :func:`sparkdl.spark.attempts.attempt_gate`); a worker holding
the secret cannot lock the running attempt out by claiming a newer one. Every connection
of an attempt must agree on its pushers (0: every worker pushes).

Snapshots. With a checkpoint directory, rank 0 asks every shard for a SNAPSHOT
right before it writes the worker checkpoint of global step ``s``; each shard
writes ``ps-shard-NNN-<s>.pt`` there (atomically, newest two kept). A stage attempt
whose HELLO says it resumes from step ``s`` first returns every shard to its
snapshot of ``s``: the state that checkpoint was taken with.

Independent tasks (``ps_barrier = false``). There are no stage attempts: each task's HELLO
names its partition (its rank) and its task attempt; :meth:`StageAttempts.begin_task` makes
that attempt the one every shard takes the partition's pushes from, and answers with the
rows of the partition whose pushes were applied. Each takeover is recorded (the partition,
the attempt, when, the rows its predecessors' pushes covered), at most
:data:`TAKEOVERS_KEPT`, and each partition's open connections and last word are kept (the
driver's stall watch reads them): all bounded by the fit's partitions.

Locking: one lock (:attr:`StageAttempts._lock`) guards the current attempt and its pushers
and is held while every store begins the new attempt, so two connections of one new
attempt cannot both restart the clocks. Under it each store's own lock is taken (never
the other way around).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from sparkdl.errors import CheckpointError, PushRejected
from sparkdl.services.ps.store import ShardStore
from sparkdl.storage.checkpoint_store import CheckpointStore

log = logging.getLogger(__name__)

#: Independent tasks: the takeovers (task attempts after the first) the history keeps.
TAKEOVERS_KEPT = 1000


class StageAttempts:
    """The stage attempt ``stores`` serve, and their snapshots in ``snapshot_dir``.

    Args:
        stores: one :class:`ShardStore` per shard.
        snapshot_dir: where shards write their snapshots ("" = snapshots refused).
        attempt_started: whether Spark really started the stage attempt a HELLO claims
            (None believes any newer attempt: for servers outside a Spark driver).
        lock: the lock a new attempt begins under (a full-batch coordinator's, which it
            publishes under too; None: one of its own).
        task_started: independent tasks: whether Spark runs task ``task_id`` for partition
            ``partition`` in the fit's stage, ``(partition, task_id) -> bool`` (None believes
            any newer task).
    """

    def __init__(
        self,
        stores: Sequence[ShardStore],
        snapshot_dir: str,
        attempt_started: Callable[[int], bool] | None,
        lock: threading.Lock | None = None,
        task_started: Callable[[int, int], bool] | None = None,
    ) -> None:
        self._stores = stores
        self._snapshots = [
            CheckpointStore(snapshot_dir, name=f"ps-shard-{i:03d}") if snapshot_dir else None
            for i in range(len(stores))
        ]
        self._attempt: int | None = None  # the stage attempt the stores serve now
        self._pushers = 0  # ... and how many push to them (0: every worker)
        # a full-batch coordinator publishes every shard's next point under this same lock,
        # so that a new attempt's clocks start from one version on every shard
        self._lock = lock or threading.Lock()
        self._attempt_started = attempt_started
        self._task_started = task_started
        self.independent = bool(stores) and all(store.independent for store in stores)
        workers = max((store.num_workers for store in stores), default=0)
        self._first_seen: list[float | None] = [None] * workers  # independent: each partition's first HELLO
        self._open = [0] * workers  # ... its open connections
        self._heard = [0.0] * workers  # ... when it last connected or closed one
        self.takeovers: collections.deque[dict[str, Any]] = collections.deque(maxlen=TAKEOVERS_KEPT)
        self._seen_attempt = [-1] * workers

    def begin_task(self, rank: int, attempt: int) -> int:
        """Independent tasks: the task of partition ``rank`` whose Spark task id
        (``taskAttemptId``: unique in the application, a retry's always larger, even across a
        stage's resubmission) is ``attempt`` connects (one connection per shard); every shard
        takes the partition's pushes from it alone from now on. A newer task than the
        partition's current one is believed only when ``task_started`` confirms Spark runs it,
        so a holder of the secret cannot fence a partition out by claiming a large id. Returns
        the partition's rows whose pushes every shard applied (the task skips them).

        Raises:
            PushRejected: a task older than the partition's current one, one Spark does not
                run for that partition, or a rank out of range.
        """
        if not 0 <= rank < len(self._seen_attempt):
            raise PushRejected(
                f"partition {rank} is not one of the fit's {len(self._seen_attempt)} partitions"
            )
        # a newer task, or the current one coming back with no connection open (which a holder
        # of the secret who read its id could claim after it ended), is asked of Spark
        newer = attempt > self._seen_attempt[rank]
        back = attempt == self._seen_attempt[rank] and not self._open[rank]
        if (newer or back) and self._task_started is not None and not self._task_started(rank, attempt):
            raise PushRejected(
                f"a HELLO claims task {attempt} of partition {rank} (current: task "
                f"{self._seen_attempt[rank]}), but Spark runs no such task of the training stage for "
                "that partition"
            )
        with self._lock:
            rows = min(store.begin_task(rank, attempt) for store in self._stores)
            now = time.time()
            if attempt > self._seen_attempt[rank]:
                if self._seen_attempt[rank] >= 0:
                    self.takeovers.append(
                        {
                            "partition": rank,
                            "task_id": attempt,
                            "replaced_task_id": self._seen_attempt[rank],
                            "time": now,
                            "rows_skipped": rows,
                        }
                    )
                    log.warning(
                        "partition %d: task %d took over from task %d; %d rows whose pushes were "
                        "applied are skipped, the rest of its partition is trained",
                        rank, attempt, self._seen_attempt[rank], rows,
                    )  # fmt: skip
                self._seen_attempt[rank] = attempt
                self._open[rank] = 0  # the fenced task's connections no longer count as the partition's
            self._open[rank] += 1
            self._heard[rank] = time.monotonic()
            return rows

    def end_task_connection(self, rank: int, attempt: int) -> None:
        """Independent tasks: a connection of task ``attempt`` of partition ``rank`` closed."""
        with self._lock:
            current = 0 <= rank < len(self._open) and attempt == self._seen_attempt[rank]
            if current and self._open[rank] > 0:
                self._open[rank] -= 1
                self._heard[rank] = time.monotonic()
                if not self._open[rank]:  # ssp: the partition holds nobody back until it is back
                    self.end_task(rank, attempt)

    def end_task(self, rank: int, attempt: int) -> None:
        """Independent tasks: task ``attempt`` of partition ``rank`` is over for every shard
        (:meth:`ShardStore.end_task`: under ssp it holds nobody back until it pushes again)."""
        for store in self._stores:
            store.end_task(rank, attempt)

    def current_task(self, rank: int) -> int:
        """Independent tasks: the task whose pushes partition ``rank``'s are (-1: none yet)."""
        with self._lock:
            return self._seen_attempt[rank]

    def silence(self) -> dict[int, float]:
        """Independent tasks: seconds since each partition whose current task has an open
        connection was last heard from (its latest push, or its connection's opening); a fenced
        task's connections do not count."""
        now = time.monotonic()
        with self._lock:
            silent = {}
            for rank, connections in enumerate(self._open):
                if connections:
                    pushes = [store.push_times[rank] for store in self._stores]
                    last = max([self._heard[rank], *(times[-1] for times in pushes if times)])
                    silent[rank] = now - last
            return silent

    def begin(self, attempt: int, start_clock: int, pushers: int = 0) -> None:
        """The first connection of a new stage attempt restarts the clocks (and restores
        the snapshot of ``start_clock`` when the workers resumed from a checkpoint); every
        connection of an attempt must agree on its pushers (0: every worker pushes).

        Raises:
            PushRejected: an older attempt, pushers that disagree, or an attempt Spark did not start.
            CheckpointError: the workers resume from a step no snapshot was taken at.
        """
        with self._lock:
            if self._attempt is not None and attempt <= self._attempt:
                if attempt < self._attempt:
                    raise PushRejected(f"stage attempt {attempt} is older than the current {self._attempt}")
                if pushers != self._pushers:
                    raise PushRejected(
                        f"a HELLO of stage attempt {attempt} says {pushers} pushers, its first said "
                        f"{self._pushers} (0 = every worker): the workers disagree about runtime.hierarchy"
                    )
                return
            if self._attempt_started is not None and not self._attempt_started(attempt):
                raise PushRejected(
                    f"a HELLO claims stage attempt {attempt} (running: {self._attempt}), but Spark "
                    "runs no such attempt of the training stage"
                )
            states = [
                self._load_snapshot(i, start_clock) if start_clock else None for i in range(len(self._stores))
            ]
            for store, state in zip(self._stores, states, strict=True):
                store.begin_attempt(attempt, start_clock, state, pushers)
            self._attempt = attempt
            self._pushers = pushers
            if start_clock:
                log.info(
                    "parameter server resumed at step %d, versions %s",
                    start_clock,
                    [s.version for s in self._stores],
                )

    def save_snapshot(self, shard: int, step: int) -> int:
        """Write ``shard``'s snapshot as of global step ``step``; return the version saved."""
        snapshots = self._snapshots[shard]
        if snapshots is None:
            raise CheckpointError("snapshot requested but the parameter server has no checkpoint_dir")
        state = self._stores[shard].snapshot()
        snapshots.save(step, {"format": 1, **state})
        return int(state["version"])

    def _load_snapshot(self, shard: int, step: int) -> dict:
        snapshots = self._snapshots[shard]
        if snapshots is None or step not in snapshots.steps():
            where = snapshots.directory if snapshots else "(no checkpoint_dir given to the server)"
            raise CheckpointError(
                f"the workers resume from step {step}, but shard {shard} has no snapshot of it in "
                f"{where}; the checkpoint directory is incomplete: start afresh with a new checkpoint_dir"
            )
        return snapshots.load(step)
