"""The executor's side of every barrier stage: where the task's worker runs, how the ranks
meet, and how its error leaves the task.

Every ``mapInArrow`` function sparkdl hands a barrier stage (fit's, ``sparkdl.run``'s, the
TorchDistributor's, the advisor's probe) runs its worker through :func:`in_barrier_task`,
which makes the one retry decision there is:

- an error every rank raised at the same point (bad input, a non-finite average, the
  user's own exception in their loop) is *agreed*: the task ends normally and hands the
  error's record back, to travel in a result row, because Spark must not re-run a stage
  that would fail alike;
- any other error fails the task with a :class:`~sparkdl.errors.WorkerFailed` whose
  message embeds the record, so that Spark re-runs the stage (resuming from a checkpoint)
  and, once every attempt failed, the driver raises the same error class with the same
  fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sparkdl.comm.rendezvous import AllGather
from sparkdl.errors import ErrorRecord, WorkerFailed
from sparkdl.services.meeting.client import gather_at
from sparkdl.services.meeting.endpoint import MeetingPoint
from sparkdl.worker.builder import Placement

T = TypeVar("T")


def in_barrier_task(
    work: Callable[[Placement, AllGather], T],
    torch_threads: int,
    meeting: MeetingPoint | None,
    timeout_s: float,
) -> tuple[int, T | ErrorRecord]:
    """Run ``work`` for this barrier task's worker: its rank, and what it returned or the
    record of an error every rank agreed on (the task then ends normally).

    Args:
        work: the worker, given its placement and how the ranks meet.
        torch_threads: torch's threads per worker (0: the task's CPUs).
        meeting: the driver's meeting point (None: Spark's ``allGather``).
        timeout_s: how long the ranks may take to meet there.

    Raises:
        WorkerFailed: any error not agreed (Spark re-runs the stage).
    """
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    placement = placement_of(ctx, torch_threads)
    rank = placement.rank
    try:
        return rank, work(placement, gather_for(ctx, meeting, placement, timeout_s))
    except Exception as exc:
        record = ErrorRecord.of(exc, rank=rank, partition=rank, attempt=ctx.attemptNumber())
        if record.agreed:
            return rank, record
        raise WorkerFailed(record) from exc


def placement_of(ctx: Any, torch_threads: int) -> Placement:
    """Where this barrier task's worker runs, from its ``BarrierTaskContext``."""
    rank = ctx.partitionId()
    infos = ctx.getTaskInfos()
    resources = ctx.resources()
    return Placement(
        rank=rank,
        world_size=len(infos),
        host=infos[rank].address.rsplit(":", 1)[0],
        gpu_addresses=tuple(resources["gpu"].addresses) if "gpu" in resources else (),
        torch_threads=torch_threads or int(ctx.cpus() or 1),
        task_attempt=ctx.taskAttemptId(),
        peers=tuple(info.address for info in infos),
    )


def gather_for(ctx: Any, meeting: MeetingPoint | None, placement: Placement, timeout_s: float) -> AllGather:
    """How the ranks meet: at the driver's store when the stage opened one (``meeting``),
    else through Spark's barrier ``allGather`` (which polls every second: 1 s more per stage)."""
    if meeting is None:
        return ctx.allGather
    return gather_at(meeting, placement.task_attempt, placement.rank, placement.world_size, timeout_s)
