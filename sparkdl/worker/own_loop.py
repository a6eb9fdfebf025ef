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
import torch

from sparkdl.comm.exchange import Where, form_hierarchy
from sparkdl.comm.meeting_point import MeetingPoint
from sparkdl.comm.ps_endpoint import PsEndpoint
from sparkdl.comm.rendezvous import AllGather
from sparkdl.config import SparkDLConfig
from sparkdl.data.feed import PartitionFeed
from sparkdl.data.inputs import DataPlan
from sparkdl.data.tensors import Batch
from sparkdl.errors import PeerStopped, SparkDLError, TrainFunctionError, WeightTransferError, agreed
from sparkdl.services.progress.channel import HeldRecords, ProgressEndpoint, reporting_to_driver
from sparkdl.services.weights.client import upload
from sparkdl.services.weights.endpoint import WeightsEndpoint
from sparkdl.training.planning import Filler
from sparkdl.worker import child as child_files
from sparkdl.worker.assembly import Placement, checkpoint_store, feed_options, join
from sparkdl.worker.context import TrainContext
from sparkdl.worker.prepare import Preparer, StepRows
from sparkdl.worker.teardown import TeardownWatchdog, socket_interface
from sparkdl.worker.torchrun import Returned

log = logging.getLogger(__name__)

_HEARTBEAT_S = 5.0
_FAILED_KEY = "sparkdl/own_loop/failed"


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
        held = stack.enter_context(HeldRecords())
        watchdog = TeardownWatchdog(config.runtime.teardown_timeout_s, rank)
        stack.callback(watchdog.disarm)
        stack.enter_context(socket_interface(config.runtime.network_interface, placement.host))
        device, groups = join(config, placement, all_gather, stack)
        where = Where(rank, placement.world_size, placement.peers, device)
        hierarchy = form_hierarchy(config.runtime, where)
        reporter = stack.enter_context(
            reporting_to_driver(spec.progress, rank, groups.attempt, heartbeat_s=_HEARTBEAT_S)
        )
        held.send_to(reporter)
        torch.manual_seed(config.training.seed)
        step = StepRows()
        preparer = Preparer(config, where, groups, hierarchy, step, stack, spec.ps)
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
            reporter,
            checkpoint_store(config, stack),
        )
        stack.callback(watchdog.arm)  # runs first on the way out: it bounds everything after it
        value = _call(spec, ctx, groups.store)
        preparer.finish()
        try:
            returned = returned_value(value, spec.weights) if rank == 0 else Returned()
        except WeightTransferError as exc:  # training is done: a re-run would not bring it back
            raise agreed(exc) from exc
        where_ = {"device": str(device), "gpus": list(placement.gpu_addresses), "host": placement.host}
        return LoopResult(returned, ctx.history if rank == 0 else [], where_)
    raise AssertionError("unreachable")  # pragma: no cover


def _call(spec: LoopSpec, ctx: TrainContext, store: Any) -> Any:
    import cloudpickle

    function, args, kwargs = cloudpickle.loads(spec.function)
    try:
        return function(ctx, *args, **kwargs)
    except (Exception, SystemExit) as exc:  # sys.exit in the function is its failure too
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            return None
        first = _claim_failure(store, ctx.rank)
        if first != ctx.rank:
            raise agreed(
                PeerStopped(f"rank {ctx.rank} stopped because rank {first} failed first ({exc})")
            ) from exc
        if isinstance(exc, SparkDLError):  # e.g. ctx.prepare's refusal, the same on every rank
            agreed(exc)
            raise
        trace = "".join(traceback.format_exception(exc))[-8000:]
        raise agreed(
            TrainFunctionError(
                f"rank {ctx.rank}: {spec.name} raised {type(exc).__qualname__}: {exc}\n{trace}",
                type(exc).__qualname__,
                1,
                trace,
            )
        ) from exc


def _claim_failure(store: Any, rank: int) -> int:
    """The rank that failed first: this one, unless another claimed it in the store first."""
    try:
        return int(store.compare_set(_FAILED_KEY, "", str(rank)).decode())
    except (RuntimeError, ValueError):  # the store's host (rank 0) is gone
        return rank


def returned_value(value: Any, weights: WeightsEndpoint | None) -> Returned:
    """Rank 0's return value for the driver: a state dict through the weights server (no
    pickle, no JVM) where it listens, else as tensors; anything else cloudpickled."""
    if child_files.is_state_dict(value):
        state = {k: v.detach().cpu().contiguous() for k, v in value.items()}
        if weights is not None:
            sent = upload(weights, state)
            log.info("rank 0 sent its returned state dict (%.1f MB) to the driver", sent / 1e6)
            return Returned(uploaded=True)
        return Returned(state_dict=state)
    if value is None:
        return Returned()
    import cloudpickle

    return Returned(pickled=cloudpickle.dumps(value))
