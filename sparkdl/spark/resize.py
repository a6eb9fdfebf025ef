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
epoch starts over on the new split from the checkpoint's weights (the rows it had trained
train again, none is left out: :func:`~sparkdl.training.checkpointing.restore`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparkdl.config import SparkDLConfig
from sparkdl.errors import ClusterConfigError, WorkersLostError
from sparkdl.spark.cluster import is_connect, parse_seconds, poll_slots
from sparkdl.spark.watch import MARGIN_S

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


def check_resizable(spark: Any, config: SparkDLConfig) -> None:
    """Refuse ``min_workers`` where fit cannot watch the slots (Spark Connect); warn where
    it would not help: no checkpoint to go on from, or a stall bound shorter than Spark's
    time to drop an unreachable host's executors (the stall would end the fit first).

    Raises:
        ClusterConfigError: a Spark Connect session.
    """
    floor, n = config.reliability.min_workers, config.training.num_workers
    if is_connect(spark):
        raise ClusterConfigError(
            f"min_workers = {floor} < num_workers = {n} needs fit to watch the cluster's task slots from "
            "the driver, which a Spark Connect client cannot; set min_workers = 0, or fit from the driver"
        )
    if not config.reliability.checkpoint_dir:
        log.warning(
            "min_workers = %d without checkpoint_dir: a fit that goes on with fewer workers starts "
            "again from the beginning; set checkpoint_dir to go on from the last checkpoint", floor
        )  # fmt: skip
    runtime = config.runtime
    network_s = parse_seconds(spark.sparkContext.getConf().get("spark.network.timeout", "120s"))
    stall_s = runtime.collective_timeout_s + runtime.teardown_timeout_s + MARGIN_S
    if network_s + runtime.executor_wait_timeout_s > stall_s:
        log.warning(
            "min_workers: Spark drops an unreachable host's executors after spark.network.timeout = "
            "%.0fs, and fit then waits executor_wait_timeout_s = %.0fs; a stage whose ranks are silent "
            "for %.0fs (collective_timeout_s + teardown_timeout_s + %.0fs) is cancelled before, and the "
            "fit fails instead of going on with fewer workers. Raise collective_timeout_s or lower "
            "spark.network.timeout", network_s, runtime.executor_wait_timeout_s, stall_s, MARGIN_S,
        )  # fmt: skip


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
    if probe() >= required:
        return None
    available = poll_slots(probe, required, wait_s, clock, sleep)
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


def next_size(
    error: BaseException,
    probe: Callable[[], int],
    required: int,
    min_workers: int,
    wait_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int | None:
    """How many workers to start the training stage again with, after it ended with
    ``error``; None: ``error`` stands (raise it).

    The watch's own :class:`WorkersLostError` (it cancelled the stage: the slots had been
    short for ``wait_s`` already) restarts at full size if the slots are back by now, else on
    those left. Any other failure restarts only on a real loss: the slots still short after
    ``wait_s`` (an executor that a standalone worker relaunches comes back, and the failure
    was not a lost host). A probe that fails (the context stopping) leaves ``error`` standing.

    Raises:
        WorkersLostError: fewer than ``min_workers`` slots are left.
    """
    ours = isinstance(error, WorkersLostError)
    try:
        workers = workers_after_loss(probe, required, min_workers, 0.0 if ours else wait_s, clock, sleep)
    except WorkersLostError:
        raise
    except Exception as exc:  # py4j: the JVM is going away
        log.warning("cannot count the cluster's task slots after the stage failed: %s", exc)
        return None
    if ours:
        return required if workers is None else workers
    return workers if workers is not None and workers < required else None


def note_resizes(history: list[dict[str, Any]], resizes: list[Resize]) -> None:
    """Mark the epoch the last resize resumed in: the history's last record that says it
    resumed (the restored records before it are the checkpoint's), else its first."""
    if not resizes or not history:
        return
    resumed = [record for record in history if "resumed_from_step" in record]
    (resumed[-1] if resumed else history[0]).update(resizes[-1].record())
