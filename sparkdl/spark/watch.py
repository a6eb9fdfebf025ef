"""The driver's bound on the training stage: a stage whose workers stop reporting is
cancelled, and ``fit`` says which rank went quiet, instead of waiting forever.

Every worker sends a heartbeat over the progress channel every few seconds from a
thread of its own, so a worker that is alive (training, or waiting in a collective that
has its own timeout) is never silent. A worker that is silent longer than the bound
(``collective_timeout_s + teardown_timeout_s`` plus a margin) is stuck where nothing of
ours can time out, e.g. holding the GIL in a destructor: the driver cancels the stage.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparkdl.errors import StageStalledError, WorkersLostError

log = logging.getLogger(__name__)

#: Added to the bound: the heartbeat period, a GC pause, a slow network.
MARGIN_S = 30.0


@dataclass(frozen=True)
class Stall:
    """The ranks silent for longer than the bound, and for how long."""

    silent: dict[int, float]
    bound_s: float

    def error(self) -> StageStalledError:
        ranks = ", ".join(f"rank {r} ({s:.0f}s)" for r, s in sorted(self.silent.items()))
        return StageStalledError(
            f"the training stage stopped reporting: {ranks} sent nothing for longer than "
            f"{self.bound_s:.0f}s (runtime.collective_timeout_s + runtime.teardown_timeout_s + "
            f"{MARGIN_S:.0f}s); fit cancelled the stage. The executor's log of that rank holds "
            "its threads' stacks; raise those timeouts if the workers are only slow",
            setting="runtime.collective_timeout_s",
            limit_s=self.bound_s,
        )


@dataclass
class SlotWatch:
    """Whether the cluster has lost the slots a stage needs for good: fewer than
    ``required`` task slots (``probe``) for longer than ``wait_s`` in a row. A barrier
    stage re-run by Spark then waits for slots that will not return, so fit cancels it,
    and goes on with fewer workers where it ``resizes`` (``reliability.min_workers``)."""

    probe: Callable[[], int]
    required: int
    wait_s: float
    resizes: bool = False  # fit goes on with fewer workers after (reliability.min_workers)
    short_since: float | None = None

    def lost(self, now: float) -> WorkersLostError | None:
        """The error to stop with, once the slots have been short for ``wait_s``."""
        available = self.probe()
        if available >= self.required:
            self.short_since = None
            return None
        if self.short_since is None:
            self.short_since = now
        if now - self.short_since < self.wait_s:
            return None
        if self.resizes:
            then = "It goes on with fewer workers (reliability.min_workers)"
        elif available == 0:
            then = (
                "No executor is left: check that their hosts are up and reach spark.driver.host; "
                "fit again then (with checkpoint_dir it resumes from the last checkpoint)"
            )
        else:
            then = (
                "Set reliability.min_workers to go on with the workers left, or fit again once they are "
                "back (with checkpoint_dir it resumes from the last checkpoint)"
            )
        return WorkersLostError(
            f"the cluster has had {available} task slot(s) for the training stage's {self.required} "
            f"workers for {now - self.short_since:.0f}s (runtime.executor_wait_timeout_s): executors "
            "were lost (their hosts stopped, or the network between them and the driver failed) and "
            f"did not come back; fit cancelled the stage. {then}",
            setting="runtime.executor_wait_timeout_s",
            limit_s=self.wait_s,
            available=available,
            required=self.required,
        )


def find_stall(silence: dict[int, float], bound_s: float) -> Stall | None:
    """The stall, if any rank has been silent for longer than ``bound_s`` (pure)."""
    silent = {rank: seconds for rank, seconds in silence.items() if seconds > bound_s}
    return Stall(silent, bound_s) if silent else None


class StallMonitor:
    """Polls ``silence()`` on a thread; on a stall, records it and calls ``cancel`` once.

    Args:
        silence: seconds since each live rank was last heard from.
        bound_s: how long a rank may be silent.
        cancel: stops the stage (e.g. ``sc.cancelJobGroup``).
        poll_s: how often to look.
        slots: also cancels once the cluster has lost the stage's slots for good.
    """

    def __init__(
        self,
        silence: Callable[[], dict[int, float]],
        bound_s: float,
        cancel: Callable[[], None],
        poll_s: float = 1.0,
        slots: SlotWatch | None = None,
    ) -> None:
        self._silence = silence
        self._bound_s = bound_s
        self._cancel = cancel
        self._poll_s = poll_s
        self._slots = slots
        self._stopped = threading.Event()
        self.stall: Stall | None = None
        self.lost: WorkersLostError | None = None
        self._thread = threading.Thread(target=self._run, name="sparkdl-stall-monitor", daemon=True)

    def __enter__(self) -> StallMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._thread.join(self._poll_s + 5.0)

    def _run(self) -> None:
        while not self._stopped.wait(self._poll_s):
            stall = find_stall(self._silence(), self._bound_s)
            if stall is not None:
                self.stall = stall
                log.error("%s", stall.error())
                self._cancel()
                return
            try:
                lost = self._slots.lost(time.monotonic()) if self._slots is not None else None
            except Exception as exc:  # py4j: the JVM busy or going away; the silence watch goes on
                log.warning("cannot count the cluster's task slots: %s", exc)
                continue
            if lost is not None:
                self.lost = lost
                log.warning("%s", lost)
                self._cancel()
                return


def fit_job_group(spark: Any) -> str:
    """The job group the training stage runs in: the user's own (their tools track it), or
    a fresh one. The stage is the group's only job from this thread while fit runs, so
    cancelling the group cancels the stage, and the group names the stage's attempts
    (:mod:`sparkdl.spark.attempts`)."""
    return spark.sparkContext.getLocalProperty("spark.jobGroup.id") or f"sparkdl-fit-{secrets.token_hex(6)}"


def collect_watched(
    spark: Any,
    stage: Any,
    silence: Callable[[], dict[int, float]] | None,
    bound_s: float,
    group: str,
    slots: SlotWatch | None = None,
) -> list[Any]:
    """``stage.collect()`` in job group ``group``, cancelled when a worker goes silent for
    longer than ``bound_s`` (or, with ``slots``, when the cluster lost the stage's slots).

    Raises:
        StageStalledError: the stage was cancelled because a rank stopped reporting.
        WorkersLostError: the stage was cancelled because its slots did not come back.
    """
    if silence is None:  # no progress channel (Spark Connect): Spark's own timeouts only
        return list(stage.collect())
    sc = spark.sparkContext
    users_group = sc.getLocalProperty("spark.jobGroup.id")
    interrupt = sc.getLocalProperty("spark.job.interruptOnCancel")
    sc.setLocalProperty("spark.jobGroup.id", group)
    sc.setLocalProperty("spark.job.interruptOnCancel", "true")
    try:
        with StallMonitor(silence, bound_s, lambda: sc.cancelJobGroup(group), slots=slots) as monitor:
            try:
                return list(stage.collect())
            except Exception as exc:
                if monitor.stall is not None:
                    raise monitor.stall.error() from exc
                if monitor.lost is not None:
                    raise monitor.lost from exc
                raise
    finally:
        sc.setLocalProperty("spark.jobGroup.id", users_group)
        sc.setLocalProperty("spark.job.interruptOnCancel", interrupt)
