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
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_POLL_S = 0.2
_FAST_POLL_S = 0.05
_SETTLED_POLL_S = 0.25
_JOIN_S = 5.0
_MAX_TASKS = 1 << 20


def attempt_gate(sc: Any, group: str, wait_s: float = 10.0) -> Callable[[int], bool]:
    """A check of ``attempt``: whether a stage of job group ``group`` runs an attempt whose
    smallest task id is ``attempt`` (re-checked for up to ``wait_s``)."""

    def started(attempt: int) -> bool:
        return _polled(lambda: attempt in running_attempts(sc, group), wait_s, "running stage attempts")

    return started


def task_gate(sc: Any, group: str, wait_s: float = 10.0) -> Callable[[int, int], bool]:
    """A check of ``(partition, task_id)`` for independent tasks: whether the newest attempt
    of a stage of job group ``group`` runs task ``task_id`` for ``partition`` (re-checked for
    up to ``wait_s``, as the store runs a little behind)."""

    def started(partition: int, task_id: int) -> bool:
        def listed() -> bool:
            return any(tasks.get(task_id) == partition for tasks in newest_attempts(sc, group).values())

        return _polled(listed, wait_s, "running tasks")

    return started


def _polled(check: Callable[[], bool], wait_s: float, what: str) -> bool:
    """Whether ``check`` (a look at Spark's status store) holds within ``wait_s``, looked at
    every ``_POLL_S``; False, logged, where the store cannot be read (it changed shape)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if check():
                return True
        except Exception as exc:  # the JVM's status store changed shape: say so, refuse
            log.warning("cannot read the %s from Spark's status store: %s", what, exc)
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)


def running_tasks(sc: Any, group: str) -> set[int]:
    """The ids of the tasks of ``group``'s stages that Spark's status store says are running."""
    tracker = sc.statusTracker()
    store = sc._jsc.sc().statusStore()
    running: set[int] = set()
    for job in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job)
        for stage in info.stageIds if info is not None else ():
            stage_info = tracker.getStageInfo(stage)
            if stage_info is None or stage_info.currentAttemptId is None or not stage_info.numActiveTasks:
                continue
            tasks = store.taskList(stage, stage_info.currentAttemptId, _MAX_TASKS)
            running.update(
                int(t.taskId())
                for t in (tasks.apply(i) for i in range(tasks.size()))
                if t.status() == "RUNNING"
            )
    return running


def running_attempts(sc: Any, group: str) -> set[int]:
    """The names (smallest task id) of the newest attempt of each stage of ``group``'s jobs."""
    return set(newest_attempts(sc, group))


def newest_attempts(sc: Any, group: str) -> dict[int, dict[int, int]]:
    """The tasks of the newest attempt of each stage of ``group``'s jobs that has started
    tasks, each task id with its index in the stage (a barrier stage's rank: its
    partition), by the attempt's name (its smallest task id)."""
    tracker = sc.statusTracker()
    store = sc._jsc.sc().statusStore()
    attempts: dict[int, dict[int, int]] = {}
    for job in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job)
        for stage in info.stageIds if info is not None else ():
            stage_info = tracker.getStageInfo(stage)
            if stage_info is None or stage_info.currentAttemptId is None:
                continue
            tasks = store.taskList(stage, stage_info.currentAttemptId, _MAX_TASKS)
            found = [tasks.apply(i) for i in range(tasks.size())]
            if found:
                ids = {int(task.taskId()): int(task.index()) for task in found}
                attempts[min(ids)] = ids
    return attempts


class AttemptPublisher:
    """Tells a fit's workers, through the driver's meeting point, which stage attempt each
    of their tasks belongs to: a task cannot see its stage attempt (PySpark's TaskContext
    has no such field, and a re-run stage's tasks start again at attempt number 0), and
    ranks that met under the wrong attempt would join a process group that no longer exists.

    A thread reads the attempts from Spark's status store (:func:`newest_attempts`) and
    publishes each new task's attempt name: every 50 ms while tasks are still coming,
    every 250 ms once a look found none new (a re-run's tasks wait that much longer).

    Args:
        sc: the SparkContext; group: the fit's job group.
        publish: ``(task_id, attempt_name, rank) -> None``, the meeting point's.
    """

    def __init__(self, sc: Any, group: str, publish: Callable[[int, int, int], None]) -> None:
        self._sc, self._group, self._publish = sc, group, publish
        self._published: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparkdl-attempts", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            settled = False  # no attempt yet, or tasks still coming
            try:
                attempts = newest_attempts(self._sc, self._group)
                new = [
                    (t, name, index)
                    for name, tasks in attempts.items()
                    for t, index in tasks.items()
                    if t not in self._published
                ]
                for task, name, index in new:
                    self._publish(task, name, index)
                    self._published.add(task)
                settled = bool(attempts) and not new
            except Exception as exc:  # the context is stopping, or the status store changed shape
                log.debug("cannot read the stage attempts from Spark's status store: %s", exc)
            self._stop.wait(_SETTLED_POLL_S if settled else _FAST_POLL_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(_JOIN_S)
