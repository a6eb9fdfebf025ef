"""The advisor's probe on one worker: a few steps of every candidate strategy, timed.

No Spark here, like :mod:`sparkdl.worker.assembly`, whose assembly it reuses: the same
process group, feed, strategy classes and training loop as ``fit``, so what it times is
what a run would do. The worker reads the first ``steps`` batches of its partition once
into the epoch cache (as a run's first epoch does), then for each candidate builds the
model, optimizer and strategy afresh and trains cached epochs over those batches: one to
warm up (DDP's buckets, the parameter server's connections, the allocator), then timed
ones until the candidate's time budget is spent. A step's time is the slowest rank's
(they wait for each other), the median over the timed epochs; an epoch's overhead is
what the slowest rank's epoch holds beyond its steps. Every candidate is probed
twice, the second pass in reverse order, and the two are averaged: on a shared machine
whose speed drifts, no candidate gains from where it stands in the list.

Last, the link: the median time of an all-reduce of one float (latency) and of the
model's size (bandwidth, capped at 16 MB so a probe of a big model on a slow network
stays short); and with ``optimizer = "lbfgs"``, a model-sized vector operation of its
algebra, timed on every worker at once (they share the host's memory as in a run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import logging
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import torch
import torch.distributed as dist

from sparkdl.comm.forming import Where, form_exchange
from sparkdl.comm.hierarchy import HostGroups
from sparkdl.comm.ps_endpoint import PsEndpoint
from sparkdl.comm.rendezvous import AllGather, ProcessGroups
from sparkdl.config import OptimizerName, SparkDLConfig
from sparkdl.data.feed import PartitionFeed
from sparkdl.strategies import SyncStrategy
from sparkdl.training.checkpointing import Position
from sparkdl.training.factory import build_optimizer
from sparkdl.training.full_batch import vector_op_seconds
from sparkdl.training.hooks import EpochTally, StepHook
from sparkdl.training.loop import Schedule, Trainer
from sparkdl.training.planning import coordinator_for, exchange_row_counts
from sparkdl.worker.assembly import TrainSpec, build_trainer, feed_options
from sparkdl.worker.builder import Builder, Placement, start_worker

log = logging.getLogger(__name__)

_LINK_CAP = 4 * 1024 * 1024  # floats in the bandwidth all-reduce (16 MB)
_MAX_REPEATS = 8
_SUM_REPEATS = 4  # L-BFGS's sums timed after the first, as the budget allows


@dataclass(frozen=True)
class ProbeCandidate:
    """One candidate as a worker trains it: its name, full settings and, for the parameter
    server, the endpoint of the server the driver started for it."""

    name: str
    config: SparkDLConfig
    ps: PsEndpoint | None = None


@dataclass(frozen=True)
class ProbeSpec:
    """Everything a probe worker needs, shipped with the task (cloudpickled).

    Attributes:
        train: the estimator's task spec (model, optimizer, loss, data plan, template).
        candidates: what to time, in order (every rank the same).
        steps: batches of its partition each worker reads (its first rows).
        budget_s: timed seconds per candidate and pass (after a warm-up epoch, one to nine timed).
        passes: times every candidate is trained, in alternating order; its figures are the mean.
    """

    train: TrainSpec
    candidates: tuple[ProbeCandidate, ...]
    steps: int
    budget_s: float
    passes: int = 2


class StepClock(StepHook):
    """The span from the start of an epoch's first step to the end of its last."""

    def __init__(self) -> None:
        self._first: float | None = None
        self._last = 0.0

    def before_step(self, position: Position) -> None:
        if self._first is None:
            self._first = time.perf_counter()

    def after_step(self, position: Position, tally: EpochTally) -> None:
        self._last = time.perf_counter()

    def take(self) -> float:
        """The last epoch's span; the clock starts afresh."""
        span = self._last - self._first if self._first is not None else 0.0
        self._first = None
        return span


def run_probe(
    spec: ProbeSpec, batches: Iterator[pa.RecordBatch], placement: Placement, all_gather: AllGather
) -> dict[str, Any]:
    """Time every candidate on this worker's first rows; return rank 0's view (the slowest
    rank's figures) as a JSON-able dict."""
    config, rank = spec.train.config, placement.rank
    with contextlib.ExitStack() as stack:
        started = start_worker(config, placement, all_gather, None, stack)  # the probe reports nothing
        where, groups, hierarchy = started.where, started.groups, started.hierarchy
        device = where.device
        rows = spec.steps * config.training.batch_size * config.training.accumulate_steps
        feed = PartitionFeed(first_rows(batches, rows), spec.train.plan, feed_options(config, rank, device))
        stack.callback(feed.close)
        stack.callback(started.watchdog.arm)  # runs first on the way out, error or not: bounds the teardown
        feed.fill_cache()  # what a run's first epoch leaves behind
        control = functools.partial(dist.all_reduce, group=groups.control)
        counts = exchange_row_counts(rank, placement.world_size, feed.cached_rows, control)
        bench = Bench(spec, feed, counts, where, groups, hierarchy, placement)
        measured: dict[str, list[dict[str, float]]] = {c.name: [] for c in spec.candidates}
        for order in _pass_orders(spec.candidates, spec.passes):
            for candidate in order:
                log.info("rank %d: probing %s", rank, candidate.name)
                measured[candidate.name].append(bench.time(candidate))
                gc.collect()  # the candidate's model and optimizer, before the next one's
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        timings = {name: _mean(runs) for name, runs in measured.items()}
        link = _measure_link(bench.params, device, placement.world_size, groups.control)
        figures = {"rank": rank, "timings": timings, "link": link, "params": bench.params, "rows": counts}
        if config.optimizer.optimizer is OptimizerName.LBFGS:
            figures.update(_full_batch_figures(bench.params, config, where, groups, hierarchy, spec.budget_s))
        return figures
    raise AssertionError("unreachable")  # pragma: no cover - the stack re-raises or returns


def _pass_orders(candidates: tuple[ProbeCandidate, ...], passes: int) -> list[tuple[ProbeCandidate, ...]]:
    """The candidates' order in each pass: forward, then backward, ... so that a machine
    whose speed drifts during the probe favours no candidate for being first or last."""
    return [candidates if p % 2 == 0 else candidates[::-1] for p in range(passes)]


def _mean(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.fmean(run[key] for run in runs) for key in runs[0]}


def first_rows(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    """The record batches of the first ``rows`` rows (the last one sliced); the rest unread."""
    left = rows
    for batch in batches:
        if left <= 0:
            return
        yield batch if batch.num_rows <= left else batch.slice(0, left)
        left -= batch.num_rows


@dataclass
class Bench:
    """What every candidate is timed on: one worker's cached rows, process groups and place.

    ``epoch`` numbers the cached epochs across candidates (each its own shuffle);
    ``steps_done`` is each candidate's global step, so that a later pass goes on where its
    earlier one stopped (its parameter server, one per candidate for the whole probe,
    expects the next clock).
    """

    spec: ProbeSpec
    feed: PartitionFeed
    counts: list[int]
    where: Where
    groups: ProcessGroups
    hierarchy: HostGroups | None
    placement: Placement
    epoch: int = 2
    params: int = 0
    steps_done: dict[str, int] = field(default_factory=dict)

    def time(self, candidate: ProbeCandidate) -> dict[str, float]:
        """Build ``candidate`` afresh and train a warm-up epoch and timed ones; its step time,
        epoch overhead and bytes per step (each the slowest rank's)."""
        config = candidate.config
        train = dataclasses.replace(self.spec.train, config=config)
        start = self.steps_done.get(candidate.name, 0)
        with contextlib.ExitStack() as built:  # the candidate's exchange and strategy, closed after it
            strategy = self._build(candidate, train, start, built)
            clock = StepClock()
            schedule = Schedule(
                1 << 20,
                config.training.batch_size,
                Position(global_steps_done=start),
                accumulate=config.training.accumulate_steps,
            )
            trainer = build_trainer(train, strategy.ctx, strategy, self.feed, schedule, [clock])
            per_step = schedule.rows_per_step
            self._epoch(trainer, clock, per_step)  # warm-up
            first = self._epoch(trainer, clock, per_step)
            epoch_s = _agreed_max(torch.tensor([first[1]]), self.groups.control)[0]
            repeats = min(_MAX_REPEATS, int(self.spec.budget_s / max(epoch_s, 1e-6)))
            samples = [first] + [self._epoch(trainer, clock, per_step) for _ in range(repeats)]
            medians = torch.tensor([statistics.median(s[i] for s in samples) for i in range(3)])
            # the slowest rank's step and epoch: the others' epochs end waiting for it, so an
            # epoch's overhead is what its slowest wall time holds beyond the slowest steps
            step_s, wall_s, sent = _agreed_max(medians, self.groups.control)
            steps = -(-max(self.counts) // per_step)
            self.steps_done[candidate.name] = trainer.global_step
        log.info("probe %s: %.2f ms a step", candidate.name, step_s * 1e3)
        return {
            "step_s": step_s,
            "epoch_overhead_s": max(wall_s - steps * step_s, 0.0),
            "bytes_per_step": sent,
        }

    def _build(
        self, candidate: ProbeCandidate, train: TrainSpec, start: int, stack: contextlib.ExitStack
    ) -> SyncStrategy:
        """Model, optimizer and strategy of ``candidate``, as ``run_worker`` builds them (the
        hierarchy's groups serve every candidate); ``stack`` closes them."""
        config = candidate.config
        torch.manual_seed(config.training.seed)
        build = Builder(config, self.where, self.groups, self.hierarchy, stack)
        module = build.module(train.model_fn, train.parallelize_fn)
        # a sharded (DTensor) parameter counts whole
        self.params = max(self.params, sum(p.numel() for p in module.parameters()))
        optimizer = build_optimizer(module.parameters(), train.optimizer_fn, config.optimizer)
        return build.strategy(
            module,
            optimizer,
            build.exchange(module),
            ps=candidate.ps,
            start_step=start,
            lr=train.lr,
            scheduler_fn=train.scheduler_fn,
        )

    def _epoch(self, trainer: Trainer, clock: StepClock, rows_per_step: int) -> tuple[float, float, float]:
        """One cached epoch: seconds per step, its wall seconds, bytes sent per step."""
        batches, source = self.feed.epoch(self.epoch)
        control = functools.partial(dist.all_reduce, group=self.groups.control)
        coordinator = coordinator_for(False, self.counts, rows_per_step, control)
        started = time.perf_counter()
        result, tally = trainer.run_epoch(self.epoch, batches, coordinator, source)
        wall = time.perf_counter() - started
        self.epoch += 1
        steps = max(tally.steps, 1)
        return clock.take() / steps, wall, result.sync.bytes_sent / steps


def _full_batch_figures(
    params: int,
    config: SparkDLConfig,
    where: Where,
    groups: ProcessGroups,
    hierarchy: HostGroups | None,
    budget_s: float,
) -> dict[str, float]:
    """With ``optimizer = "lbfgs"``, what its pass adds to the batches, timed on every worker
    at once (the slowest rank's): the sums of a pass as a run makes them (its totals over the
    control group, then the gradient through the exchange ``fit`` forms: shared memory among
    a host's workers, the network between hosts), and one model-sized vector operation of
    its algebra (:func:`~sparkdl.training.full_batch.vector_op_seconds`). The sums are timed
    once after a warm-up, then as often again as ``budget_s`` holds (at most 4 more)."""
    gradient = torch.zeros(params, device=where.device)
    exchange = form_exchange(config.runtime, where, groups, 4 * params, True, hierarchy)

    def timed_sum() -> float:
        started = time.perf_counter()
        exchange.sum_control_(torch.zeros(3, dtype=torch.float64))
        exchange.weighted_sum_([[("gradient", gradient)]], 1.0, lossless=True)
        if gradient.is_cuda:  # NCCL's wait holds the stream, not the host
            torch.cuda.synchronize(gradient.device)
        return time.perf_counter() - started

    try:
        timed_sum()  # warms up the connections and buffers
        first = _agreed_max(torch.tensor([timed_sum()]), groups.control)[0]
        # as many more as the budget holds (a big model's sum over a slow link takes seconds),
        # the count agreed, so every rank makes the same collectives
        repeats = min(_SUM_REPEATS, int(budget_s / max(first, 1e-6)))
        times = [first] + [timed_sum() for _ in range(repeats)]
    finally:
        exchange.close()
    op_s = vector_op_seconds(params, config.lbfgs.history_size, where.device)
    sum_s, op_s = _agreed_max(torch.tensor([statistics.median(times), op_s]), groups.control)
    return {"gradient_sum_s": sum_s, "vector_op_s": op_s}


def _agreed_max(values: torch.Tensor, group: dist.ProcessGroup | None) -> list[float]:
    """The element-wise maximum over the ranks (the slowest rank sets a synchronous pace)."""
    values = values.to(torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in values.tolist()]


def _measure_link(
    params: int, device: torch.device, world_size: int, control: dist.ProcessGroup | None
) -> dict[str, float]:
    """Median seconds of an all-reduce of one float and of ``min(params, 4M)`` floats on the
    default group (the data path: gloo or NCCL), the slowest rank's."""
    floats = max(1, min(params, _LINK_CAP))
    tiny_s = _timed_all_reduce(torch.zeros(1, device=device), 20)
    model_s = _timed_all_reduce(torch.zeros(floats, device=device), 5)
    tiny_s, model_s = _agreed_max(torch.tensor([tiny_s, model_s]), control)
    return {"tiny_s": tiny_s, "model_s": model_s, "floats": floats, "workers": world_size}


def _timed_all_reduce(tensor: torch.Tensor, repeats: int) -> float:
    dist.all_reduce(tensor)  # warm-up: the connections, the buffers
    times = []
    for _ in itertools.repeat(None, repeats):
        started = time.perf_counter()
        dist.all_reduce(tensor)
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)
