"""Going on with fewer workers when executors are lost for good (``reliability.min_workers``).

A barrier stage needs all its slots at once. When a host goes away and does not come
back, Spark re-runs the failed training stage and its tasks wait for slots that will not
return; the driver's watch cancels it once the slots have been short for
``runtime.executor_wait_timeout_s`` (:class:`~sparkdl.spark.watch.SlotWatch`). ``fit`` then
asks :func:`workers_after_loss` how many workers to go on with, and starts the stage again
on that many: every worker resumes from the last checkpoint (checkpoints are whole, so they
load under any number of workers), the data re-split among them. Without a checkpoint the
fit starts again from the beginning.

What changes under a smaller world (the training guide says it to users): each step sees
``batch_size x workers`` rows, so the steps per epoch grow and the learning rate is left
as it was (no rescaling: linear-scaling rules are the user's choice); the interrupted
epoch resumes at the checkpoint's step count, so on the new split some of its rows may
train twice and none is left out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparkdl.errors import WorkersLostError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resize:
    """One restart of the training stage on another number of workers."""

    before: int
    after: int
    at: float  # wall time (time.time()) of the decision
    cause: str  # the failure that ended the stage before

    def record(self) -> dict[str, Any]:
        """What the history's resumed epoch says of it."""
        return {"workers": self.after, "lost_workers": self.before - self.after, "resized_at": self.at}


def workers_after_loss(
    probe: Callable[[], int],
    required: int,
    min_workers: int,
    wait_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int | None:
    """How many workers to go on with after the training stage of ``required`` workers
    failed, ``probe`` counting the cluster's task slots: None when the slots are all there
    (the failure was no loss of executors: it stands); ``required`` when they come back
    within ``wait_s``; else the slots left, when at least ``min_workers``.

    Raises:
        WorkersLostError: fewer than ``min_workers`` slots are left after ``wait_s``.
    """
    available = probe()
    if available >= required:
        return None
    deadline = clock() + wait_s
    while available < required and clock() < deadline:
        sleep(min(0.5, max(deadline - clock(), 0.0)))
        available = probe()
    if available >= required:
        return required
    if available >= max(min_workers, 1):
        return available
    raise WorkersLostError(
        f"executors were lost: the cluster has {available} task slot(s) left for {required} workers "
        f"after waiting {wait_s:.0f}s, fewer than reliability.min_workers = {min_workers}; lower "
        "min_workers to go on with fewer, or bring the executors back and fit again (it resumes from "
        "the checkpoint)",
        setting="runtime.executor_wait_timeout_s",
        limit_s=wait_s,
        available=available,
        required=required,
    )


def note_resizes(history: list[dict[str, Any]], resizes: list[Resize]) -> None:
    """Mark the epoch the last resize resumed in: the history's last record that says it
    resumed (the restored records before it are the checkpoint's), else its first."""
    if not resizes or not history:
        return
    resumed = [record for record in history if "resumed_from_step" in record]
    (resumed[-1] if resumed else history[0]).update(resizes[-1].record())
