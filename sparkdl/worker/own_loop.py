"""One worker of ``sparkdl.run``: the Estimator's worker assembly (device, process groups,
hierarchy, progress, feed, checkpoints, one exit stack) around the user's own function
instead of sparkdl's loop.

No Spark here, as in :mod:`sparkdl.worker.assembly`: the caller passes the partition's
record batches, the placement and how the ranks meet.

The first failure. When the user's function raises on one rank, that rank claims the
run's failure in the process group's store before it tears its process group down; the
others, whose collectives then fail on the closed connections, find the claim and stop as
:class:`~sparkdl.errors.PeerStopped`, so the driver raises the first rank's error.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import torch.distributed as dist

from sparkdl.comm.ps_endpoint import PsEndpoint
from sparkdl.comm.rendezvous import AllGather
from sparkdl.config import SparkDLConfig
from sparkdl.data.feed import PartitionFeed
from sparkdl.data.inputs import DataPlan
from sparkdl.data.tensors import Batch
from sparkdl.errors import (
    CollectiveError,
    ParameterServerError,
    PeerStopped,
    SparkDLError,
    TrainFunctionError,
    WeightTransferError,
    agreed,
)
from sparkdl.services.meeting.endpoint import MeetingPoint
from sparkdl.services.progress.channel import ProgressEndpoint
from sparkdl.services.weights.endpoint import WeightsEndpoint
from sparkdl.training.own_loop import RunningStep
from sparkdl.training.planning import Filler
from sparkdl.worker.assembly import checkpoint_store, feed_options
from sparkdl.worker.builder import Builder, Placement, start_worker
from sparkdl.worker.context import TrainContext
from sparkdl.worker.prepare import Preparer
from sparkdl.worker.returned import Returned, returned_value

log = logging.getLogger(__name__)

_FAILED_KEY = "sparkdl/own_loop/failed"
_RETURNED_KEY = "sparkdl/own_loop/returned"


@dataclass(frozen=True)
class LoopSpec:
    """One ``sparkdl.run``, as every worker needs it (shipped with the task).

    Attributes:
        config: the run's settings.
        function: the cloudpickled ``(train_fn, args, kwargs)``.
        name: the function's name, for errors.
        plan: how the DataFrame's columns become tensors (None: no DataFrame).
        template: two decoded rows, the filler of a worker without any.
        progress, weights, meeting: the driver's endpoints (None where it has none).
        ps: the parameter server's endpoint (strategy "parameter_server").
    """

    config: SparkDLConfig
    function: bytes
    name: str
    plan: DataPlan | None = None
    template: Batch | None = None
    progress: ProgressEndpoint | None = None
    weights: WeightsEndpoint | None = None
    meeting: MeetingPoint | None = None
    ps: PsEndpoint | None = None


@dataclass
class LoopResult:
    """What one worker brings back: rank 0's return value and history, each rank's device."""

    returned: Returned
    history: list[dict[str, Any]] = field(default_factory=list)
    device: dict[str, Any] = field(default_factory=dict)


def run_own_loop(
    spec: LoopSpec, batches: Iterator[pa.RecordBatch], placement: Placement, all_gather: AllGather
) -> LoopResult:
    """Assemble this worker, call ``train_fn(ctx, *args, **kwargs)``, bring back its value.

    Raises:
        TrainFunctionError: the function raised here first (agreed: Spark does not re-run it).
        PeerStopped: it failed because another rank failed first.
    """
    config, rank = spec.config, placement.rank
    with contextlib.ExitStack() as stack:
        started = start_worker(config, placement, all_gather, spec.progress, stack)
        device, groups = started.device, started.groups
        step = RunningStep()
        build = Builder(config, started.where, groups, started.hierarchy, stack)
        preparer = Preparer(build, step, spec.ps)
        feed = None
        if spec.plan is not None:
            feed = PartitionFeed(batches, spec.plan, feed_options(config, rank, device))
            stack.callback(feed.close)
        ctx = TrainContext(
            config,
            rank,
            placement.world_size,
            device,
            preparer,
            step,
            groups.control,
            feed,
            Filler(spec.template),
            started.reporter,
            checkpoint_store(config, stack),
        )
        stack.callback(started.watchdog.arm)  # runs first on the way out: it bounds everything after it
        value = _call(spec, ctx, groups.store)
        try:
            ctx.finish()  # the strategies' last sync, every rank together
        except Exception as exc:
            raise _failure(exc, spec.name, ctx, groups.store, returned=True) from exc
        try:
            returned = returned_value(value, spec.weights) if rank == 0 else Returned()
        except WeightTransferError as exc:  # training is done: a re-run would not bring it back
            raise agreed(exc) from exc
        where_ = {"device": str(device), "gpus": list(placement.gpu_addresses), "host": placement.host}
        return LoopResult(returned, ctx.history if rank == 0 else [], where_)
    raise AssertionError("unreachable")  # pragma: no cover


def _call(spec: LoopSpec, ctx: TrainContext, store: Any) -> Any:
    """``train_fn(ctx, ...)``; this rank's return is marked in the store (where it returned,
    for the ranks still training to name it), a failure classified (:func:`_failure`)."""
    import cloudpickle

    function, args, kwargs = cloudpickle.loads(spec.function)
    try:
        value = function(ctx, *args, **kwargs)
    except (Exception, SystemExit) as exc:  # sys.exit in the function is its failure too
        if not (isinstance(exc, SystemExit) and exc.code in (0, None)):
            raise _failure(exc, spec.name, ctx, store, returned=False) from exc
        value = None
    _mark_returned(store, ctx.rank, ctx.global_step)
    return value


def _failure(exc: BaseException, name: str, ctx: TrainContext, store: Any, returned: bool) -> SparkDLError:
    """What the driver should raise for ``exc`` on this rank (which had ``returned`` from the
    function, or not), marked agreed (re-running would fail alike): another rank's first
    failure (PeerStopped); a failed collective while the ranks were not all in the function
    together (CollectiveError naming who was where); else the error itself."""
    rank = ctx.rank
    first = _claim_failure(store, rank)
    if first != rank:
        return agreed(PeerStopped(f"rank {rank} stopped because rank {first} failed first ({exc})"))
    if _is_communication(exc):
        others = _returned(store, ctx.world_size, rank)
        absent = [r for r in range(ctx.world_size) if r != rank and r not in others]
        if not returned and others:
            where = ", ".join(f"rank {r} at step {step}" for r, step in others.items())
            return agreed(
                _mismatch(
                    f"rank {rank} was still training at step {ctx.global_step} of {name} "
                    f"when {where} had returned from it",
                    exc,
                )
            )
        if returned and absent:
            return agreed(
                _mismatch(
                    f"rank {rank} had returned from {name} at step {ctx.global_step} while "
                    f"rank(s) {absent} had not",
                    exc,
                )
            )
    if isinstance(exc, SparkDLError):  # e.g. ctx.prepare's refusal, the same on every rank
        return agreed(exc)
    trace = "".join(traceback.format_exception(exc))[-8000:]
    return agreed(
        TrainFunctionError(
            f"rank {rank}: {name} raised {type(exc).__qualname__}: {exc}\n{trace}",
            type(exc).__qualname__,
            1,
            trace,
        )
    )


def _is_communication(exc: BaseException) -> bool:
    """A failed collective or exchange: torch's distributed errors (gloo's and NCCL's), ours."""
    return isinstance(exc, (dist.DistError, CollectiveError, ParameterServerError))


def _mismatch(where: str, exc: BaseException) -> CollectiveError:
    return CollectiveError(
        f"{where}: a collective ran on some ranks only. Every rank must run the same collectives: "
        f"take every batch of ctx.batches for the same epochs, and return together ({exc})"
    )


def _claim_failure(store: Any, rank: int) -> int:
    """The rank that failed first: this one, unless another claimed it in the store first."""
    try:
        return int(store.compare_set(_FAILED_KEY, "", str(rank)).decode())
    except (RuntimeError, ValueError):  # the store's host (rank 0) is gone
        return rank


def _mark_returned(store: Any, rank: int, step: int) -> None:
    try:
        store.set(f"{_RETURNED_KEY}/{rank}", str(step))
    except RuntimeError:  # the store's host (rank 0) is gone: nobody is left to tell
        pass


def _returned(store: Any, world_size: int, rank: int) -> dict[int, int]:
    """The ranks other than ``rank`` that returned from the function, with their step."""
    found: dict[int, int] = {}
    for other in range(world_size):
        key = f"{_RETURNED_KEY}/{other}"
        try:
            if other != rank and store.check([key]):
                found[other] = int(store.get(key).decode())
        except (RuntimeError, ValueError):
            continue
    return found
