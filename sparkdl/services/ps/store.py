"""The parameter server's state: versioned weight shards, each with its own optimizer.

Pure: torch and threading only, no sockets, so the clock rules are tested directly.

Clocks. Worker ``r`` pushes clock ``t`` after its ``t``-th step (0-based) and then
pulls clock ``t + 1``. A shard's ``version`` counts the updates it has applied.

- ``sync``: the pushes of clock ``t`` are summed (each is a rows-weighted gradient
  sum) and, once all workers have pushed, divided by the rows and applied as one
  optimizer step: version ``t + 1``. A pull of clock ``c`` waits for version ``c``.
  With plain SGD this is exactly all-reduce SGD.
- ``ssp`` (stale-synchronous): updates are applied per clock as in ``sync``, but a
  pull of clock ``c`` only waits for version ``c - staleness``: a worker may run up to
  ``staleness`` clocks ahead of the slowest. ``staleness = 0`` is ``sync``.
- ``async`` (Downpour): every push is applied on arrival (its rows-weighted mean);
  pulls never wait. Staleness of a push = updates applied since the version the
  worker computed it on.
- ``sync`` with ``backup_workers = b`` (Chen et al., "Revisiting distributed synchronous
  SGD"): a clock is applied once the first ``N - b`` workers pushed it; a later push
  of that clock is dropped and counted (its ACK says by how many clocks it was late),
  and a pull answers how many clocks the server is past the one asked for, so that a
  worker that fell behind skips ahead instead of setting the pace.

Resume. A stage attempt may start at clock ``s`` > 0 (the workers resumed from the
checkpoint of global step ``s``); the store is then restored from its snapshot of
step ``s`` and clocks count from ``s``: a pull of clock ``c`` waits for version
``base + c - s`` (``base``: the version when the attempt began).

Coordinated (``optimizer = "lbfgs"``). A store built with a ``handoff`` has no optimizer:
each complete clock's mean gradient and mean loss go to the driver's L-BFGS coordinator
(:mod:`sparkdl.services.ps.full_batch`), and the next version exists once the coordinator
:meth:`~ShardStore.publish`-es the next point to evaluate; :meth:`~ShardStore.finish` then
answers every pull that the run has ended.

What a pusher can make the store hold or apply is bounded. A push of a clock more than
``staleness`` clocks past the next one to be applied is refused (no honest worker pushes one:
its pull of that clock waited for the clocks before it), so at most ``staleness + 1``
clocks are pending; before, one holder of the fit's secret pushing clocks far ahead kept a
gradient sum per clock (164 MB for 40 pushes). And every update is checked: one that leaves
a weight NaN or infinite (finite gradients can: three pushes of 3e38) is undone, the shard
keeps its weights from before it, and its push is refused; the weights served stay finite.

Independent tasks (``parameter_server.ps_barrier = false``, async or ssp). Each worker is an
ordinary Spark task that fails and is retried alone, so a store built ``independent`` keeps,
per partition (the worker's rank), the task attempt whose pushes it takes (a newer attempt's
:meth:`~ShardStore.begin_task` fences the older: its later pushes are refused), the rows
whose pushes it applied (a retry skips them) and the times of its latest pushes. These are
bounded by the fit's partitions (``num_workers``) and :data:`PUSH_TIMES_KEPT` each.
Every push is applied on arrival. Under ``ssp`` each partition also has a clock (its pushes
applied) and is live from its current task's first push until that task has no connection
left, or the driver finds Spark no longer runs it (:meth:`~ShardStore.end_task`); a pull
waits while its partition is more than ``staleness`` clocks ahead of the slowest *live*
other partition. A task that died, finished, has not started or has not pushed yet
(building its model, skipping its predecessor's rows) holds nobody back, and a task joins,
at its first push, at the slowest live partition's clock, on the server's current weights
(Ho et al.'s bounded staleness over the workers present).

Memory: two copies of the weights (the second, the weights before the update being applied)
and the optimizer state per shard, plus one gradient accumulator per clock in flight (at
most ``staleness + 1``), never one per worker.
"""

from __future__ import annotations

import collections
import copy
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sparkdl.config import PsMode
from sparkdl.errors import CoordinatorFailed, PsAborted, PsTimeoutError, PushRejected
from sparkdl.training.schedules import CONSTANT_LR, LrPlan, ScheduledLr

#: Independent tasks: the push times each partition's record keeps (the latest).
PUSH_TIMES_KEPT = 4096

OptimizerFn = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class _Clock:
    grad_sum: torch.Tensor
    rows: int = 0
    pushed: set[int] = field(default_factory=set)
    loss_sum: float = 0.0


#: ``(store, mean gradient, mean loss, rows)``: a complete clock, handed to the coordinator.
Handoff = Callable[["ShardStore", torch.Tensor, float, int], None]


class ShardStore:
    """One shard of the model: whole parameter tensors, their optimizer, their clocks.

    Args:
        params: the shard's parameters (the store owns them and their ``.grad``).
        optimizer_fn: builds the shard's optimizer over ``params``.
        mode: sync, async or ssp.
        num_workers: workers that push to this shard.
        staleness: ssp bound (ignored otherwise).
        clock: monotonic clock, patched in tests.
        lr: the learning-rate schedule, applied at the global step each version stands for.
        scheduler_fn: the user's LR scheduler over this shard's optimizer, stepped per version.
        steps_per_version: global steps one version stands for (see the host).
        backup_workers: sync: apply a clock once ``num_workers - backup_workers`` pushed it.
        handoff: coordinated: a complete clock goes here instead of to an optimizer
            (``optimizer_fn`` is then None), and the next version waits for :meth:`publish`.
        independent: async or ssp workers as independent tasks: pushes are fenced per
            partition (:meth:`begin_task`) and each partition's applied rows are counted.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        optimizer_fn: OptimizerFn | None,
        mode: PsMode,
        num_workers: int,
        staleness: int = 0,
        clock: Callable[[], float] = time.monotonic,
        lr: LrPlan = CONSTANT_LR,
        scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
        steps_per_version: float = 1.0,
        backup_workers: int = 0,
        handoff: Handoff | None = None,
        independent: bool = False,
    ) -> None:
        if (optimizer_fn is None) == (handoff is None):
            raise ValueError("a store takes an optimizer_fn, or a handoff to a coordinator: one of them")
        if not 0 <= backup_workers < num_workers:
            raise ValueError(
                f"backup_workers = {backup_workers} must be >= 0 and < the {num_workers} workers"
            )
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.optimizer = optimizer_fn(params) if optimizer_fn is not None else None
        self._handoff = handoff
        self.finished = False  # coordinated: the run ended; every pull is answered so
        self._lr = None if lr.is_constant or self.optimizer is None else ScheduledLr(self.optimizer, lr)
        self._scheduler = (
            scheduler_fn(self.optimizer) if scheduler_fn is not None and self.optimizer is not None else None
        )
        self._steps_per_version = steps_per_version
        self.mode = mode
        self.num_workers = num_workers
        self._workers = num_workers  # as configured: an attempt may push through fewer (its hosts)
        self._backup = backup_workers if mode is PsMode.SYNC else 0
        self.staleness = staleness if mode is PsMode.SSP else 0
        self.dropped = 0  # late pushes of clocks already applied without them
        self.version = 0
        self.attempt = 0
        self._base_version = 0  # version when the current stage attempt began
        self._start_clock = 0  # the first clock of the current stage attempt
        self._clock = clock
        self._cond = threading.Condition()
        self._pending: dict[int, _Clock] = {}
        self._spare: list[torch.Tensor] = []  # sums of applied clocks, reused
        self._before: list[torch.Tensor] = []  # the weights before the update being applied
        self.nonfinite_updates = 0  # updates undone: they left a weight NaN or infinite
        self._next_clock = [0] * num_workers  # the clock each worker pushes next
        self._closed = False
        self._aborted = ""  # why a worker stopped this attempt
        self._failed = ""  # coordinated: why the coordinator failed (every attempt, for good)
        if independent and mode is PsMode.SYNC:
            raise ValueError("independent tasks push as they come (async or ssp); this store is sync")
        self.independent = independent
        self._task_attempts = [-1] * num_workers  # independent: the attempt each partition's pushes come from
        self.rows_applied = [0] * num_workers  # independent: rows of each partition in the weights
        self.task_clocks = [0] * num_workers  # independent ssp: each partition's pushes applied ...
        self._live = [False] * num_workers  # ... and whether its current task is connected
        self.push_times: list[collections.deque[float]] = [
            collections.deque(maxlen=PUSH_TIMES_KEPT) for _ in range(num_workers)
        ]

    @property
    def coordinated(self) -> bool:
        """Whether a coordinator, not an optimizer, makes this store's versions."""
        return self._handoff is not None

    def close(self) -> None:
        """Wake every waiting pull; they fail at once (the server is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def abort(self, reason: str) -> None:
        """A worker stopped: fail every waiting and later pull and push of this attempt."""
        with self._cond:
            self._aborted = reason
            self._cond.notify_all()

    def fail(self, reason: str) -> None:
        """Coordinated: the coordinator failed; every pull and push, of this attempt and of
        any later one, fails with ``reason`` (:class:`CoordinatorFailed`)."""
        with self._cond:
            self._failed = reason
            self._cond.notify_all()

    def begin_attempt(
        self, attempt: int, start_clock: int = 0, state: dict[str, Any] | None = None, pushers: int = 0
    ) -> None:
        """A (re-run) stage attempt connects; its clocks start at ``start_clock``.

        Without ``state`` the weights are kept (the workers start afresh on them);
        with one, the store first returns to that snapshot (the workers resumed from
        the checkpoint it was taken with). ``pushers`` > 0: this attempt's pushes come
        from that many pushers, numbered from 0 (the hosts' leaders of a hierarchy), not
        from every worker.
        """
        pushers = pushers or self._workers
        if not self._backup < pushers <= self._workers:
            raise PushRejected(
                f"stage attempt {attempt} pushes through {pushers} pushers; this server takes 1 to "
                f"{self._workers} (and more than backup_workers = {self._backup})"
            )
        with self._cond:
            if attempt < self.attempt:
                raise PushRejected(f"stage attempt {attempt} is older than the current {self.attempt}")
            self.num_workers = pushers
            if state is not None:
                self._load(state)
            self.attempt = attempt
            self._aborted = ""
            self._pending.clear()
            self._next_clock = [start_clock] * self.num_workers
            self._start_clock = start_clock
            self._base_version = self.version
            self._cond.notify_all()

    def begin_task(self, rank: int, attempt: int) -> int:
        """Independent tasks: task attempt ``attempt`` of partition ``rank`` connects; from now
        on only its pushes are taken for that partition (an older attempt's are refused).
        Returns the partition's rows whose pushes were applied (what the attempt skips).

        Raises:
            PushRejected: not an independent store, a rank out of range, or an attempt older
                than the one the partition's pushes come from.
        """
        with self._cond:
            if not self.independent:
                raise PushRejected("a task HELLO on a store of barrier workers (ps_barrier = true)")
            if not 0 <= rank < self.num_workers:
                raise PushRejected(f"partition {rank} is not one of the fit's {self.num_workers} partitions")
            current = self._task_attempts[rank]
            if attempt < current:
                raise PushRejected(
                    f"task {attempt} of partition {rank} is older than task {current}, whose "
                    "pushes the server takes now (a zombie or a speculative copy): refused"
                )
            if attempt > current:  # not live until its first push: nobody waits while it starts
                self._live[rank] = False
                self._cond.notify_all()
            self._task_attempts[rank] = attempt
            return self.rows_applied[rank]

    def end_task(self, rank: int, attempt: int) -> None:
        """Independent tasks: task ``attempt`` of partition ``rank`` has no connection left
        (finished, failed or cut off); under ``ssp`` its clock holds nobody back until a task of
        the partition connects again. A fenced task's end changes nothing."""
        with self._cond:
            if 0 <= rank < self.num_workers and attempt == self._task_attempts[rank]:
                self._live[rank] = False
                self._cond.notify_all()

    def _slowest_live(self, rank: int, default: int) -> int:
        """The smallest clock of the live partitions other than ``rank`` (``default``: none)."""
        return min(
            (c for r, c in enumerate(self.task_clocks) if self._live[r] and r != rank), default=default
        )

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of the shard: weights, optimizer state, version (plain tensors)."""
        with self._cond:
            optimizer = self.optimizer.state_dict() if self.optimizer is not None else {}
            return {
                "version": self.version,
                "params": [p.detach().clone() for p in self.params],
                "optimizer": copy.deepcopy(optimizer),
                # independent tasks: the rows each partition's pushes put in these weights
                **({"rows_applied": list(self.rows_applied)} if self.independent else {}),
            }

    def restore(self, state: dict[str, Any]) -> None:
        """Return to a :meth:`snapshot` (a new fit resuming on the driver's snapshot of an
        earlier one's server: independent tasks, whose partitions' rows it restores too).

        Raises:
            PushRejected: the snapshot is of another model, or of another number of partitions.
        """
        rows = state.get("rows_applied")
        if self.independent and (rows is None or len(rows) != self.num_workers):
            raise PushRejected(
                f"the server's snapshot holds the rows of {'no' if rows is None else len(rows)} partitions, "
                f"this fit has {self.num_workers}; resume with the DataFrame's partitions (num_workers) "
                "the checkpoint was written with, or start afresh with a new checkpoint_dir"
            )
        with self._cond:
            self._load(state)
            if self.independent and rows is not None:
                self.rows_applied = [int(r) for r in rows]

    def _load(self, state: dict[str, Any]) -> None:
        shapes = [tuple(t.shape) for t in state["params"]]
        if shapes != [tuple(p.shape) for p in self.params]:
            raise PushRejected(
                f"the snapshot holds parameters of shapes {shapes}, this shard "
                f"{[tuple(p.shape) for p in self.params]}; resume with the model and ps_shards "
                "the checkpoint was written with, or start afresh with a new checkpoint_dir"
            )
        with torch.no_grad():
            for p, saved in zip(self.params, state["params"], strict=True):
                p.copy_(saved)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])

    def push(
        self,
        rank: int,
        attempt: int,
        clock: int,
        rows: int,
        grad_sum: torch.Tensor,
        loss_sum: float = 0.0,
        dropped: int = 0,
    ) -> int:
        """Add a worker's rows-weighted gradient sum (and, coordinated, its rows' summed loss);
        return its staleness (async) or 0. ``dropped``: an independent task's rows of steps it
        dropped (non-finite) since its last push, counted with the partition's rows covered.

        The store may scale ``grad_sum`` in place, but keeps no reference to it once this
        returns: the caller reads the next push into the same memory.
        """
        with self._cond:
            if self._failed:
                raise CoordinatorFailed(self._failed)
            if self._aborted:
                raise PsAborted(self._aborted)
            self._check_push(rank, attempt, clock, grad_sum)
            self._next_clock[rank] = clock + 1
            if self.mode is PsMode.ASYNC or self.independent:
                staleness = max(self.version - clock, 0)  # async: clock = version it was based on
                if rows > 0 and not self._apply(grad_sum.div_(rows)):
                    raise self._undone(f"rank {rank}'s push based on version {clock}")
                if self.independent:  # under the lock of the update: counted once it is in the weights
                    self.rows_applied[rank] += max(rows, 0) + max(dropped, 0)
                    if not self._live[rank]:  # its first push: it joins at the slowest live clock
                        own = self.task_clocks[rank]
                        self.task_clocks[rank] = self._slowest_live(rank, own)
                        self._live[rank] = True
                    self.task_clocks[rank] += 1
                    self.push_times[rank].append(self._clock())
                self._cond.notify_all()
                return staleness
            late = self.applied_clock - clock
            if late > 0 and self.coordinated:  # every pass counts: none may be dropped unseen
                raise PushRejected(
                    f"rank {rank} pushed pass {clock}, which this shard already handed over; the "
                    "coordinator's passes and this attempt's clocks disagree"
                )
            if late > 0:  # backup workers: this clock went ahead without it
                self.dropped += 1
                return late
            entry = self._pending.get(clock)
            if entry is None:  # the caller's buffer is reused: sum into one of ours
                spare = self._spare.pop() if self._spare else torch.empty_like(grad_sum)
                entry = self._pending[clock] = _Clock(spare.copy_(grad_sum))
            else:
                entry.grad_sum += grad_sum
            entry.rows += rows
            entry.loss_sum += loss_sum
            entry.pushed.add(rank)
            undone = self._apply_complete_clocks()
            if undone:
                raise self._undone(f"clock {undone[0]}, which rank {rank}'s push completed,")
            return 0

    def pull(
        self, rank: int, clock: int, timeout_s: float, out: torch.Tensor | None = None
    ) -> tuple[int, torch.Tensor]:
        """Weights for a worker about to compute clock ``clock``: (version, flat float32 copy),
        the copy written to ``out`` when given (``numel`` float32 values)."""
        deadline = self._clock() + timeout_s
        with self._cond:
            while not self._ready(rank, clock):
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise self.pull_timeout(rank, clock, timeout_s)
                self._cond.wait(remaining)
            return self.version, self.flat_weights(out)

    def try_pull(
        self, rank: int, clock: int, out: torch.Tensor | None = None
    ) -> tuple[int, torch.Tensor] | None:
        """:meth:`pull` without the wait: the weights if clock ``clock`` may be computed on
        them now, None while it may not (the caller asks again after a later push)."""
        with self._cond:
            return (self.version, self.flat_weights(out)) if self._ready(rank, clock) else None

    def pull_timeout(self, rank: int, clock: int, timeout_s: float) -> PsTimeoutError:
        """The error of a pull of ``clock`` that waited ``timeout_s`` in vain: whom it waited for."""
        with self._cond:
            if self.independent:
                mine = self.task_clocks[rank]
                clocks = self.task_clocks
                behind = [r for r, c in enumerate(clocks) if self._live[r] and c < mine - self.staleness]
                return PsTimeoutError(
                    f"partition {rank}: its pull at clock {mine} waited {timeout_s:.0f}s for live "
                    f"partition(s) {behind} (clocks {[clocks[r] for r in behind]}) to come within "
                    f"staleness = {self.staleness}; their tasks are stuck or slow. Raise "
                    "parameter_server.ps_timeout_s or staleness, or use ps_mode = 'async'",
                    setting="parameter_server.ps_timeout_s",
                    limit_s=timeout_s,
                )
            clock_needed = self._start_clock + self._clocks_needed(clock)
            behind = [r for r, c in enumerate(self._next_clock) if c <= clock_needed - 1]
            at = [self._next_clock[r] for r in behind]
        if self.coordinated:
            return PsTimeoutError(
                f"rank {rank}: pull of pass {clock} waited {timeout_s:.0f}s for worker(s) {behind} to "
                "push their pass; with optimizer 'lbfgs' a pull waits for every worker's whole pass "
                "(the first streams from Spark): raise parameter_server.ps_timeout_s, or give the "
                "workers equal partitions",
                setting="parameter_server.ps_timeout_s",
                limit_s=timeout_s,
            )
        return PsTimeoutError(
            f"rank {rank}: pull of clock {clock} waited {timeout_s:.0f}s for worker(s) {behind} "
            f"(next clocks {at}) to push clock {clock_needed - 1}; a worker is stuck or slow. "
            "Raise parameter_server.ps_timeout_s, or use ps_mode = 'async' or 'ssp' with a larger staleness",
            setting="parameter_server.ps_timeout_s",
            limit_s=timeout_s,
        )

    def _needed(self, clock: int) -> int:
        """The version a pull of ``clock`` waits for."""
        return self._base_version + self._clocks_needed(clock)

    def _clocks_needed(self, clock: int) -> int:
        """How many clocks of this attempt a pull of ``clock`` waits to see applied."""
        return max(clock - self._start_clock - self.staleness, 0)

    def _ready(self, rank: int, clock: int) -> bool:
        """Whether a pull of ``clock`` is answered now (under the lock); raises once the
        attempt was aborted, the coordinator failed or the server stopped."""
        if self._failed:
            raise CoordinatorFailed(self._failed)
        if self._aborted:
            raise PsAborted(self._aborted)
        if self.mode is PsMode.ASYNC or self.finished:
            return True
        if self.independent:  # ssp over the live partitions: the pull's clock is the server's count
            mine = self.task_clocks[rank]
            if not self._live[rank] or mine - self._slowest_live(rank, mine) <= self.staleness:
                return True
        elif self.version >= self._needed(clock):
            return True
        if self._closed:
            raise PsTimeoutError(
                f"rank {rank}: the parameter server stopped while pull of clock {clock} waited",
                setting="parameter_server.ps_timeout_s",
            )
        return False

    @property
    def pending_clocks(self) -> int:
        """Clocks pushed and not applied yet, each holding a gradient sum (at most ``staleness + 1``)."""
        with self._cond:
            return len(self._pending)

    @property
    def quorum(self) -> int:
        """Pushes that make a clock (sync with backup workers: fewer than the pushers)."""
        return self.num_workers - self._backup

    @property
    def applied_clock(self) -> int:
        """The next clock this attempt applies (every earlier one is in the weights)."""
        return self._start_clock + self.version - self._base_version

    def ahead_of(self, clock: int) -> int:
        """How many clocks past ``clock`` the weights already are (sync with backup workers)."""
        with self._cond:
            return max(self.applied_clock - clock, 0) if self.quorum < self.num_workers else 0

    def flat_weights(self, out: torch.Tensor | None = None) -> torch.Tensor:
        flat = [p.detach().reshape(-1).float() for p in self.params]
        return torch.cat(flat) if out is None else torch.cat(flat, out=out)

    def _check_push(self, rank: int, attempt: int, clock: int, grad_sum: torch.Tensor) -> None:
        if not 0 <= rank < self.num_workers:
            raise PushRejected(f"rank {rank} is not one of the {self.num_workers} workers")
        if self.independent and attempt != self._task_attempts[rank]:
            raise PushRejected(
                f"push from task {attempt} of partition {rank}; the server takes that partition's "
                f"pushes from task {self._task_attempts[rank]} (a stale task's are refused)"
            )
        if not self.independent and attempt != self.attempt:
            raise PushRejected(f"push from stage attempt {attempt}; the current attempt is {self.attempt}")
        if grad_sum.numel() != self.numel or grad_sum.dtype != torch.float32:
            raise PushRejected(
                f"gradient of {grad_sum.numel()} {grad_sum.dtype} values; this shard holds "
                f"{self.numel} float32 values"
            )
        if self.mode is PsMode.ASYNC or self.independent:  # applied on arrival, kept nowhere
            return
        expected = self._next_clock[rank]
        skipped_ahead = self.quorum < self.num_workers and clock > expected  # a backup that caught up
        if clock != expected and not skipped_ahead:
            raise PushRejected(
                f"rank {rank} pushed clock {clock}, expected {self._next_clock[rank]} (duplicate or skipped)"
            )
        if clock > self.applied_clock + self.staleness:  # its pull would still wait: kept, it holds a sum
            raise PushRejected(
                f"rank {rank} pushed clock {clock}, {clock - self.applied_clock} clocks past clock "
                f"{self.applied_clock}, the next this shard applies; a push may run at most "
                f"{self.staleness} clocks ahead (the staleness; 0 in sync mode), so it was not kept"
            )

    def _apply_complete_clocks(self) -> list[int]:
        """Apply every complete clock, in order; return those whose update was undone (each
        passed as a clock that moved nothing, so that the pulls waiting for it go on)."""
        undone: list[int] = []
        while True:
            entry = self._pending.get(self.applied_clock)
            if entry is None or len(entry.pushed) < self.quorum:
                return undone
            clock = self.applied_clock
            del self._pending[clock]
            if self._handoff is not None:  # the coordinator takes it; publish() makes the version
                self._handoff(
                    self,
                    entry.grad_sum.div(max(entry.rows, 1)),
                    entry.loss_sum / max(entry.rows, 1),
                    entry.rows,
                )
                if len(self._spare) < 2:
                    self._spare.append(entry.grad_sum)
                return undone  # one clock at a time: the next cannot be complete before the next version
            if not entry.rows:  # no worker trained a row in this clock (e.g. an evaluation pass)
                self.version += 1
            elif not self._apply(entry.grad_sum.div_(entry.rows)):
                undone.append(clock)
                self.version += 1  # as a clock of no rows: nothing moves
            if len(self._spare) < 2:  # warm memory for a later clock (no page faults)
                self._spare.append(entry.grad_sum)
            self._cond.notify_all()

    def publish(self, point: torch.Tensor) -> None:
        """Coordinated: the next point to evaluate (flat, this shard's values) becomes the
        weights of the next version, and the pulls waiting for it are answered."""
        with torch.no_grad(), self._cond:
            offset = 0
            for p in self.params:
                p.copy_(point[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            self.version += 1
            self._cond.notify_all()

    def finish(self, point: torch.Tensor | None = None) -> None:
        """Coordinated: the run ended at ``point`` (None: keep the weights); every pull,
        waiting or later, is answered that no pass is left."""
        with torch.no_grad(), self._cond:
            if point is not None:
                offset = 0
                for p in self.params:
                    p.copy_(point[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
            self.finished = True
            self._cond.notify_all()

    def _apply(self, grad: torch.Tensor) -> bool:
        """One optimizer step on ``grad`` (flat, float32); False when it left a weight NaN or
        infinite: the weights are then as before it (its optimizer state as the step left it:
        a later update it spoils is undone as well) and the version does not move."""
        assert self.optimizer is not None, "a coordinated store hands its clocks over"
        offset = 0
        for p in self.params:
            view = grad[offset : offset + p.numel()].view_as(p)
            p.grad = view if view.dtype == p.dtype else view.to(p.dtype)  # grad is ours: no copy
            offset += p.numel()
        if self._lr is not None:  # the global step this version stands for
            self._lr.apply(int(self.version * self._steps_per_version))
        with torch.no_grad():
            if not self._before:
                self._before = [torch.empty_like(p) for p in self.params]
            for before, p in zip(self._before, self.params, strict=True):
                before.copy_(p)
            self.optimizer.step()
            for p in self.params:  # zero_grad(set_to_none=True) without its wrapper's 8 us
                p.grad = None
            if not all(all_finite(p) for p in self.params):
                for before, p in zip(self._before, self.params, strict=True):
                    p.copy_(before)
                self.nonfinite_updates += 1
                return False
        if self._scheduler is not None:
            self._scheduler.step()
        self.version += 1
        return True

    def _undone(self, what: str) -> PushRejected:
        return PushRejected(
            f"the update of {what} left a weight NaN or infinite and was undone: the shard keeps its "
            "weights from before it (a push of huge values, or a learning rate too high: lower "
            "optimizer.lr, or clip the gradients)"
        )


def all_finite(values: torch.Tensor) -> bool:
    """Whether every value is finite: one float32 sum (NaN and infinities carry through it);
    only a sum that overflowed needs the element-wise look."""
    return math.isfinite(values.sum()) or bool(torch.isfinite(values).all())
