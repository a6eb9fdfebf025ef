"""Which stage attempts of a fit Spark really runs, as the driver's servers need to know.

A worker names its stage attempt by the smallest ``taskAttemptId`` of its barrier stage
(every rank agrees on it when they meet: :mod:`sparkdl.comm.rendezvous`). The
parameter server restarts its clocks, and the progress channel forgets the old ranks,
when a newer attempt says HELLO; a worker holding the fit's secret could claim any
number and lock the real attempt out. So the driver believes an attempt only when
Spark's own status store lists it: a stage of the fit's job group whose newest attempt's
smallest task id is the one claimed. The store is fed by Spark's listener bus, a little
behind the tasks, so a claim is re-checked for up to ``wait_s`` before it is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_POLL_S = 0.2
_MAX_TASKS = 1 << 20


def attempt_gate(sc: Any, group: str, wait_s: float = 10.0) -> Callable[[int], bool]:
    """A check of ``attempt``: whether a stage of job group ``group`` runs an attempt whose
    smallest task id is ``attempt`` (re-checked for up to ``wait_s``)."""

    def started(attempt: int) -> bool:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if attempt in running_attempts(sc, group):
                    return True
            except Exception as exc:  # the JVM's status store changed shape: say so, refuse
                log.warning("cannot read the running stage attempts from Spark's status store: %s", exc)
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)

    return started


def running_attempts(sc: Any, group: str) -> set[int]:
    """The names (smallest task id) of the newest attempt of each stage of ``group``'s jobs."""
    tracker = sc.statusTracker()
    store = sc._jsc.sc().statusStore()
    names: set[int] = set()
    for job in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job)
        for stage in info.stageIds if info is not None else ():
            stage_info = tracker.getStageInfo(stage)
            if stage_info is None or stage_info.currentAttemptId is None:
                continue
            tasks = store.taskList(stage, stage_info.currentAttemptId, _MAX_TASKS)
            ids = [tasks.apply(i).taskId() for i in range(tasks.size())]
            if ids:
                names.add(min(ids))
    return names
