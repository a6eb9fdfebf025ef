"""Full-batch training: each evaluation of the objective is one pass over every worker's
whole partition, and L-BFGS (:mod:`sparkdl.training.lbfgs`) drives the passes.

The objective is the mean loss over every row of every partition (weighted by the weight
column where there is one), plus ``weight_decay / 2 * |w|^2``: exactly what one process
would compute on the union of the partitions. With ``lbfgs.objective = "spark"`` it is
Spark ML's ``LogisticRegression``'s instead: the weighted rows' sum over the weights' sum,
and the L2 term over every weight but the biases (the intercepts). (Spark's
``LinearRegression`` halves its squared error, so ``mse`` matches it without weight decay.)
A worker sums its rows' losses and gradients, and one sum over the workers (the worker's
exchange, as every strategy's sums) makes the mean. The first pass streams the partition
from Spark into the epoch cache; every later one replays the cache.

With strategy allreduce every worker holds every vector whole
(:class:`ReplicatedVectors`) and takes the same decisions on the same numbers, so the
workers never disagree on a step; a sum's result is the same on every rank, since a
collective hands every rank the same reduced numbers.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from sparkdl.comm.exchange import Exchange
from sparkdl.data.tensors import Batch, call_model
from sparkdl.errors import BadDataError, PeerStopped, SparkDLError, TrainingFailedError, agreed
from sparkdl.training.lbfgs import Iteration, Lbfgs, LbfgsSettings, LbfgsState
from sparkdl.training.losses import LossFn
from sparkdl.training.precision import Precision

log = logging.getLogger(__name__)


class PassSource(Protocol):
    """The worker's rows, pass after pass (the partition feed: pass 1 streams from Spark)."""

    @property
    def cached_rows(self) -> int: ...

    def epoch(self, epoch: int) -> tuple[Iterable[Batch], str]: ...


class Objective:
    """The mean loss over every worker's rows at the module's current weights, and its
    gradient, flat: one pass over this worker's rows and one sum over the workers.

    Args:
        module: the bare model (every rank holds it whole).
        source: this worker's rows.
        loss_fn: ``(output, target, weight) -> mean loss`` of a batch.
        keyword: call the model as ``model(**inputs)``.
        exchange: the sums over the workers.
        weight_decay: the L2 term's factor (``weight_decay / 2 * |w|^2``).
        check_labels: finds labels the model cannot take, while the rows stream.
        precision: autocast of forward and loss.
        rank: this worker, for messages.
        spark: Spark ML's objective: the rows' weighted sum over the weights' sum (not the
            row count), and no L2 term on a parameter named ``bias``.
    """

    def __init__(
        self,
        module: nn.Module,
        source: PassSource,
        loss_fn: LossFn,
        keyword: bool,
        exchange: Exchange,
        weight_decay: float,
        check_labels: Callable[[Batch], BadDataError | None],
        precision: Precision,
        rank: int,
        spark: bool = False,
    ) -> None:
        self._module = module
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        self._spark = spark
        # which values the L2 term covers (None: every one): Spark ML leaves the intercepts out
        biases = [n.rpartition(".")[2] == "bias" for n, _ in named]
        self._decayed: torch.Tensor | None = None
        if spark and any(biases):
            kept = [float(not bias) for bias in biases]
            self._decayed = torch.cat(
                [torch.full((p.numel(),), k, device=p.device) for (_, p), k in zip(named, kept, strict=True)]
            )
        self._device = next(module.parameters()).device
        self._source = source
        self._loss_fn = loss_fn
        self._keyword = keyword
        self._exchange = exchange
        self._weight_decay = weight_decay
        self._check_labels = check_labels
        self._precision = precision
        self._rank = rank
        self.passes = 0
        self._weight_sum = 0.0  # this worker's weight column's sum in the last pass (spark)
        self.rows = 0  # every worker's rows, once the first pass has counted them
        self.local_rows = 0  # this worker's
        self.output_shape: tuple[int, ...] = ()
        self.input_shapes: dict[str, tuple[int, ...]] = {}

    @property
    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def __call__(self) -> tuple[float, torch.Tensor]:
        """The objective and its gradient (a new flat tensor) at the module's weights."""
        loss_sum, rows, rejected = self.local_pass()
        local = [loss_sum, float(rows), float(rejected is not None), self._weight_sum]
        totals = torch.tensor(local, dtype=torch.float64)
        self._exchange.sum_control_(totals)
        global_loss, global_rows, rejections, global_weight = totals.tolist()
        if rejections:
            raise agreed(
                rejected
                or PeerStopped(f"rank {self._rank} stopped because another worker rejected its input")
            )
        if global_rows == 0:
            raise agreed(
                BadDataError(
                    "the DataFrame given to fit has no rows: every partition was empty. "
                    "Check the filters and joins upstream of fit",
                    bad_rows=0,
                )
            )
        self.rows, self.local_rows = int(global_rows), rows
        gradient = flat_gradient(self._params)
        self._exchange.weighted_sum_([[("gradient", gradient)]], 1.0, lossless=True)
        divisor = global_weight if self._spark else global_rows
        if divisor <= 0:
            raise agreed(
                BadDataError(
                    f"lbfgs.objective = 'spark' divides by the weight column's sum, which is {divisor:g} "
                    "over every row; give rows positive weights",
                    bad_rows=0,
                )
            )
        gradient.div_(divisor)
        loss = global_loss / divisor
        if self._weight_decay:
            weights = torch.cat([p.detach().reshape(-1) for p in self._params])
            if self._decayed is not None:
                weights.mul_(self._decayed)
            gradient.add_(weights, alpha=self._weight_decay)
            loss += 0.5 * self._weight_decay * float(weights.double().square().sum())
        return loss, gradient

    def local_pass(self) -> tuple[float, int, SparkDLError | None]:
        """This worker's summed loss and rows, its summed gradient left in ``.grad``; the
        error of an input it rejects while streaming (every rank then stops together)."""
        for p in self._params:
            p.grad = None
        self.passes += 1
        batches, source = self._source.epoch(self.passes)
        streaming = source == "spark"
        loss_sum = torch.zeros((), dtype=torch.float64, device=self._device)  # read once, at the end
        weight_sum = torch.zeros((), dtype=torch.float64, device=self._device)
        self._weight_sum = 0.0
        rows = 0
        self._module.train()
        iterator = iter(batches)
        while True:
            try:
                batch = next(iterator, None)
            except SparkDLError as exc:
                if not streaming:
                    raise
                return 0.0, rows, exc
            if batch is None:
                break
            if streaming and (rejected := self._check_labels(batch)) is not None:
                return 0.0, rows, rejected
            loss = self._batch_loss(batch)
            (loss * len(batch)).backward()
            loss_sum += loss.detach().double() * len(batch)
            rows += len(batch)
            if self._spark:
                weight_sum += batch.weight.double().sum() if batch.weight is not None else len(batch)
        self._weight_sum = float(weight_sum)
        return float(loss_sum), rows, None

    def _batch_loss(self, batch: Batch) -> torch.Tensor:
        batch = batch.to(self._device)
        with self._precision.autocast():
            output = call_model(self._module, batch, self._keyword)
            if not self.output_shape:
                self.output_shape, self.input_shapes = tuple(output.shape[1:]), batch.shapes()
            return self._loss_fn(output, batch.label, batch.weight).float()


def iteration_record(iteration: Iteration, rows: int, seconds: float) -> dict[str, Any]:
    """One iteration's entry of ``history`` (every layout's): its figures, and the samples
    its passes read over every worker's ``rows``, in ``seconds``."""
    samples = rows * iteration.evaluations
    return {
        "epoch": iteration.iteration,
        "iteration": iteration.iteration,
        "loss": iteration.loss,
        "grad_max": iteration.grad_max,
        "step_length": iteration.step,
        "evaluations": iteration.evaluations,
        "passes": iteration.total_evaluations,
        "samples": samples,
        "seconds": seconds,
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
    }


def check_finite(loss: float, gradient: torch.Tensor, passes: int) -> None:
    """Stop the run, with the fix, where it stands on an objective or gradient that is not
    finite. Raised alike by every rank, which sees the same sums.

    Raises:
        TrainingFailedError: naming the pass and the loss.
    """
    if math.isfinite(loss) and bool(torch.isfinite(gradient).all()):
        return
    raise agreed(
        TrainingFailedError(
            f"L-BFGS reached a non-finite objective or gradient at pass {passes} (loss {loss:.4g}); "
            "lower lr (the line search's first step), scale the inputs, or add weight_decay"
        )
    )


def flat_gradient(params: list[nn.Parameter]) -> torch.Tensor:
    """Every parameter's gradient in one new flat tensor (zeros where a parameter has none)."""
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params])


class ReplicatedVectors:
    """L-BFGS's vectors held whole on every worker, as flat tensors on the model's device.

    ``"x"`` starts as the module's weights; every evaluation and move writes the point
    into the module, so that the module always holds the point last evaluated or moved to.
    """

    def __init__(self, objective: Objective, tensors: dict[str, torch.Tensor] | None = None) -> None:
        self._objective = objective
        self._params = objective.parameters
        self._v: dict[str, torch.Tensor] = dict(tensors or {})
        if "x" not in self._v:
            self._v["x"] = torch.cat([p.detach().reshape(-1) for p in self._params]).clone()
        self._write(self._v["x"])

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every vector by name (what a checkpoint keeps)."""
        return self._v

    def evaluate(self, t: float, out: str) -> float:
        x = self._v["x"]
        self._write(x if t == 0.0 else x.add(self._v["d"], alpha=t))
        loss, gradient = self._objective()
        self._v[out] = gradient
        return loss

    def move(self, t: float) -> None:
        self._v["x"].add_(self._v["d"], alpha=t)
        self._write(self._v["x"])

    def dot(self, a: str, b: str) -> float:
        return float(self._v[a].dot(self._v[b]))

    def axpy(self, alpha: float, x: str, y: str) -> None:
        self._v[y].add_(self._v[x], alpha=alpha)

    def scale(self, v: str, alpha: float) -> None:
        self._v[v].mul_(alpha)

    def copy(self, src: str, dst: str) -> None:
        if dst in self._v:
            self._v[dst].copy_(self._v[src])
        else:
            self._v[dst] = self._v[src].clone()

    def rename(self, src: str, dst: str) -> None:
        self._v[dst] = self._v.pop(src)

    def delete(self, v: str) -> None:
        del self._v[v]

    def abs_max(self, v: str) -> float:
        return float(self._v[v].abs().max())

    def abs_sum(self, v: str) -> float:
        return float(self._v[v].abs().sum())

    @torch.no_grad()
    def _write(self, point: torch.Tensor) -> None:
        offset = 0
        for p in self._params:
            p.copy_(point[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


@dataclass(frozen=True)
class Saved:
    """A full-batch run as a checkpoint holds it: the scalars, the vectors and the history."""

    state: LbfgsState
    vectors: dict[str, torch.Tensor]
    history: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "lbfgs": self.state.to_dict(),
            "vectors": {k: v.detach().cpu() for k, v in self.vectors.items()},
            "history": self.history,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], device: torch.device) -> Saved:
        vectors = {k: v.to(device) for k, v in data["vectors"].items()}
        return cls(LbfgsState.from_dict(data["lbfgs"]), vectors, list(data["history"]))


class FullBatchTrainer:
    """Runs L-BFGS on one worker; every worker runs it in step with the others.

    Args:
        settings: the optimizer's settings.
        objective: the passes and their sums.
        exchange: what the run sent, reported per iteration.
        resumed: a checkpointed run to continue (None: start at the module's weights).
        validate: the held-out figures of the module's weights (every rank calls it after
            every iteration; None: no validation).
        after_iteration: called after every iteration with the run as a checkpoint would
            hold it (checkpoints, progress); every rank calls it.
    """

    def __init__(
        self,
        settings: LbfgsSettings,
        objective: Objective,
        exchange: Exchange,
        resumed: Saved | None = None,
        validate: Callable[[], dict[str, float]] | None = None,
        after_iteration: Callable[[Saved], None] = lambda _: None,
    ) -> None:
        self._objective = objective
        self._exchange = exchange
        self._vectors = ReplicatedVectors(objective, resumed.vectors if resumed else None)
        accept = lambda loss: check_finite(loss, self._vectors.tensors["g"], objective.passes)  # noqa: E731
        self._lbfgs = Lbfgs(self._vectors, settings, resumed.state if resumed else None, accept)
        self._history = list(resumed.history) if resumed else []
        self._validate = validate
        self._after = after_iteration
        self._started = time.perf_counter()

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self._objective.output_shape

    @property
    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        return self._objective.input_shapes

    def run(self) -> list[dict[str, Any]]:
        """Iterate to a stopping test; the history, one record per iteration."""
        stop = self._lbfgs.run(self._record)
        if not self._history:  # the start point already met a tolerance
            state = self._lbfgs.state
            self._history.append(self._entry(Iteration(0, state.loss, self._vectors.abs_max("g"), 0.0, 1, 1)))
        self._history[-1]["stopped"] = stop.value
        log.info("L-BFGS stopped after %d iterations: %s", self._lbfgs.state.iteration, stop.value)
        return self._history

    def _record(self, iteration: Iteration) -> None:
        entry = self._entry(iteration)
        if self._validate is not None:
            entry.update(self._validate())
        self._history.append(entry)
        self._after(Saved(self._lbfgs.state, self._vectors.tensors, self._history))

    def _entry(self, iteration: Iteration) -> dict[str, Any]:
        now = time.perf_counter()
        seconds, self._started = now - self._started, now
        entry = iteration_record(iteration, self._objective.rows, seconds)
        entry.update(
            local_samples=self._objective.local_rows * iteration.evaluations,
            nan_skips=0,
            bytes_sent=self._exchange.take_traffic().bytes_sent,
        )
        return entry


#: vector_op_seconds times at most this many bytes of vectors, each at most VECTOR_VALUES long
VECTOR_BYTES = 512_000_000
VECTOR_VALUES = 32_000_000


def vector_op_seconds(params: int, history: int, device: torch.device, repeats: int = 3) -> float:
    """One model-sized float32 vector operation on ``device``, the mean of a dot product and
    an axpy over L-BFGS's working set (its ``2 history`` pairs' vectors and four more, as far
    as :data:`VECTOR_BYTES` allows): the same vectors again and again would time the cache,
    which a real history larger than it never stays in. Vectors longer than
    :data:`VECTOR_VALUES` are timed at that length and scaled (the operations stream memory).
    The advisor's price of L-BFGS's algebra."""
    size = max(min(params, VECTOR_VALUES), 1)
    count = max(2, min(2 * history + 4, VECTOR_BYTES // (4 * size)))
    vectors = [torch.full((size,), 1.0 / (i + 1), device=device) for i in range(count)]
    direction = torch.zeros(size, device=device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for v in vectors:  # as the two-loop recursion: a dot and an axpy per vector
            float(v.dot(direction))  # a host sync on a GPU, as the algorithm's scalars are
            direction.add_(v, alpha=-1e-3)
        best = min(best, (time.perf_counter() - start) / (2 * count))
    return best * params / size
