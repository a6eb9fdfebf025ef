"""Sandblaster's coordinator: L-BFGS driven from the driver, its vectors kept on the shards.

With ``optimizer = "lbfgs"`` and strategy ``parameter_server`` the shards have no optimizer
(:class:`~sparkdl.services.ps.store.ShardStore` built with a ``handoff``). Each shard holds
its slice of every L-BFGS vector (the point, the gradient, the direction, the history
pairs) beside its weights; the coordinator thread runs :class:`~sparkdl.training.lbfgs.Lbfgs`
over :class:`ShardedVectors`, whose dot products are sums of the shards' and whose axpys run
shard by shard, so the driver handles scalars only and no shard holds another's slice.

An evaluation of the objective: each shard publishes its slice of the point as its next
version; every worker pulls it, makes one pass over its partition and pushes its summed
gradient and loss; a shard's complete clock is handed back here as the mean gradient.
The workers never decide anything: they compute passes until a pull answers FINISHED.

Faults: a re-run stage attempt starts its clocks at the shards' current version, so its
workers compute the evaluation the coordinator is waiting for; nothing is lost but the
failed attempt's partial pushes. The coordinator's own waits end when the server stops
(the workers' pulls are bounded by ``ps_timeout_s``, and the fit by its watchdogs).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from sparkdl.errors import BadDataError, CoordinatorFailed
from sparkdl.services.ps.store import ShardStore
from sparkdl.training.full_batch import check_finite, iteration_record
from sparkdl.training.lbfgs import Iteration, Lbfgs, LbfgsSettings

log = logging.getLogger(__name__)


class _Stopped(Exception):
    """The server is stopping: the coordinator leaves its run where it is."""


class ShardedVectors:
    """L-BFGS's vectors as slices, one per shard, each beside its shard's weights.

    Built first, so that its :meth:`receive` can be the stores' handoff; then
    :meth:`attach` gives it the stores, whose weights are the starting point.

    Args:
        weight_decay: the objective's L2 term, ``weight_decay / 2 * |w|^2`` over the
            parameters that train.
    """

    def __init__(self, weight_decay: float) -> None:
        self._stores: list[ShardStore] = []
        self._index: dict[int, int] = {}
        self._weight_decay = weight_decay
        self._slices: list[dict[str, torch.Tensor]] = []
        self._decayed: list[torch.Tensor | None] = []  # per shard: 1 where a value trains (None: all)
        #: a new stage attempt begins under this lock (the server's StageAttempts), and every
        #: shard's next point is published under it: an attempt never starts between two shards
        self.attempt_lock = threading.Lock()
        self._cond = threading.Condition()
        self._arrived: dict[int, tuple[torch.Tensor, float, int]] = {}
        self._evaluations = 0
        self._stopped = False
        self.rows = 0  # every worker's rows, once the first pass counted them

    def attach(self, stores: Sequence[ShardStore]) -> None:
        """The shards, their weights the starting point. A frozen parameter
        (``requires_grad=False``) takes no weight decay: its gradient is zero, so with none
        its direction stays zero and it never moves, as in the all-reduce variant."""
        self._stores = list(stores)
        self._index = {id(store): i for i, store in enumerate(self._stores)}
        self._slices = [{"x": store.flat_weights().clone()} for store in self._stores]
        self._decayed = []
        for store in self._stores:
            if all(p.requires_grad for p in store.params):
                self._decayed.append(None)
            else:
                masks = [torch.full((p.numel(),), float(p.requires_grad)) for p in store.params]
                self._decayed.append(torch.cat(masks))

    def receive(self, store: ShardStore, gradient: torch.Tensor, loss: float, rows: int) -> None:
        """A shard's complete clock (the store's handoff, under its lock: only records it)."""
        with self._cond:
            self._arrived[self._index[id(store)]] = (gradient, loss, rows)
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def slices(self, name: str) -> list[torch.Tensor]:
        return [each[name] for each in self._slices]

    def evaluate(self, t: float, out: str) -> float:
        points = [each["x"] if t == 0.0 else each["x"].add(each["d"], alpha=t) for each in self._slices]
        if self._evaluations:  # the first evaluation is of the weights the shards started with
            with self.attempt_lock:
                for store, point in zip(self._stores, points, strict=True):
                    store.publish(point)
        self._evaluations += 1
        arrived = self._wait()
        loss = self._agreed_loss(arrived)
        for each, point, decayed, (gradient, _, _) in zip(
            self._slices, points, self._decayed, arrived, strict=True
        ):
            if self._weight_decay:
                trains = point if decayed is None else point * decayed
                gradient.add_(trains, alpha=self._weight_decay)
                loss += 0.5 * self._weight_decay * float(trains.double().square().sum())
            each[out] = gradient
        for each in self._slices:  # slice by slice: the driver never joins them
            check_finite(loss, each[out], self._evaluations)
        return loss

    def _agreed_loss(self, arrived: list[tuple[torch.Tensor, float, int]]) -> float:
        """The pass's mean loss, once every shard saw the same rows and loss (every worker
        pushes both to every shard) and as many rows as every earlier pass.

        Raises:
            BadDataError: no worker had a row.
            CoordinatorFailed: the shards disagree (a worker pushed different passes to
                different shards, or a pass of a different size).
        """
        rows = {entry[2] for entry in arrived}
        losses = [entry[1] for entry in arrived]
        if rows == {0}:
            raise BadDataError(
                "the DataFrame given to fit has no rows: every partition was empty. Check the filters "
                "and joins upstream of fit",
                bad_rows=0,
            )
        spread = max(losses) - min(losses)
        if len(rows) > 1 or spread > 1e-9 * max(1.0, abs(losses[0])) or self.rows not in (0, *rows):
            raise CoordinatorFailed(
                f"pass {self._evaluations}: the shards received {sorted(rows)} rows and losses "
                f"{losses} (every earlier pass: {self.rows} rows); every worker must push one pass of "
                "its whole partition to every shard"
            )
        self.rows = rows.pop()
        return losses[0]

    def _wait(self) -> list[tuple[torch.Tensor, float, int]]:
        with self._cond:
            while len(self._arrived) < len(self._stores):
                if self._stopped:
                    raise _Stopped
                self._cond.wait(1.0)
            arrived = [self._arrived[i] for i in range(len(self._stores))]
            self._arrived.clear()
            return arrived

    def move(self, t: float) -> None:
        for each in self._slices:
            each["x"].add_(each["d"], alpha=t)

    def dot(self, a: str, b: str) -> float:
        # float32 slice by slice, as the replicated vectors' whole dot (a float64 copy of
        # every slice made each dot 3-4x slower on the driver: measured on a 4.3M-value model)
        return sum(float(each[a].dot(each[b])) for each in self._slices)

    def axpy(self, alpha: float, x: str, y: str) -> None:
        for each in self._slices:
            each[y].add_(each[x], alpha=alpha)

    def scale(self, v: str, alpha: float) -> None:
        for each in self._slices:
            each[v].mul_(alpha)

    def copy(self, src: str, dst: str) -> None:
        for each in self._slices:
            if dst in each:
                each[dst].copy_(each[src])
            else:
                each[dst] = each[src].clone()

    def rename(self, src: str, dst: str) -> None:
        for each in self._slices:
            each[dst] = each.pop(src)

    def delete(self, v: str) -> None:
        for each in self._slices:
            del each[v]

    def abs_max(self, v: str) -> float:
        return max(float(each[v].abs().max()) if each[v].numel() else 0.0 for each in self._slices)

    def abs_sum(self, v: str) -> float:
        return sum(float(each[v].abs().sum()) for each in self._slices)

    def names(self) -> set[str]:
        """The vectors each shard holds now (the same on every shard)."""
        return set(self._slices[0])


class Coordinator:
    """Runs L-BFGS over the shards on a thread of the driver for one fit.

    Args:
        vectors: the shards' vectors (attached to ``stores``).
        stores: the coordinated shard stores (built with ``vectors.receive`` as their handoff).
        settings: the algorithm's settings.
    """

    def __init__(
        self, vectors: ShardedVectors, stores: Sequence[ShardStore], settings: LbfgsSettings
    ) -> None:
        self.vectors = vectors
        self._stores = list(stores)
        self._lbfgs = Lbfgs(vectors, settings)
        self.history: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="sparkdl-lbfgs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """The fit is over (or failed): leave the run where it is and end the thread."""
        self.vectors.stop()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            stop = self._lbfgs.run(self._record)
        except _Stopped:
            return
        except BaseException as exc:  # every worker stops with it, this attempt and any re-run
            self.error = exc
            log.error("L-BFGS coordinator failed: %s: %s", type(exc).__name__, exc)
            for store in self._stores:
                store.fail(f"the driver's L-BFGS coordinator failed: {type(exc).__name__}: {exc}")
            return
        if not self.history:  # the start point already met a tolerance
            state = self._lbfgs.state
            self._record(Iteration(0, state.loss, self.vectors.abs_max("g"), 0.0, 1, 1))
        self.history[-1]["stopped"] = stop.value
        for store, x in zip(self._stores, self.vectors.slices("x"), strict=True):
            store.finish(x)  # the shards hold the point reached; every pull now says so
        log.info("L-BFGS stopped after %d iterations: %s", self._lbfgs.state.iteration, stop.value)

    def _record(self, iteration: Iteration) -> None:
        now = time.perf_counter()
        seconds, self._started = now - self._started, now
        entry = iteration_record(iteration, self.vectors.rows, seconds)
        entry["vectors_per_shard"] = len(self.vectors.names())
        self.history.append(entry)
