"""Weight averaging every ``sync_every`` local steps (SparkNet; "local SGD").

Each worker trains its own copy of the model on its own partition with no
communication at all; every ``tau = sync_every`` steps the workers average
parameters, floating-point buffers (batch-norm running statistics) and, by default,
the optimizer state (momentum, Adam moments) in one bucketed all-reduce. A final
average at the end of training leaves every worker, and the returned model, with
the same weights.

Averaging weights. Each worker's contribution is weighted by the rows it trained on
since the previous average: ``w <- sum_i n_i w_i / sum_i n_i``. A worker whose
partition ran out (or was empty) has ``n_i = 0`` and simply receives the average,
so it never drags the model back toward stale weights. With plain SGD, tau = 1 and
full batches this is exactly gradient averaging: ``sum_i n_i (w - lr g_i) / n =
w - lr * (mean gradient over all rows)``; with momentum and averaged optimizer
state it still is, because the momentum update is linear too.

Optimizer state. With ``average_optimizer_state = true`` (default) every floating
tensor in ``optimizer.state`` is averaged as well, once every worker holds it (a
worker that has not stepped yet has no momentum buffer). Integer or scalar
bookkeeping (Adam's step count) is the same on every worker and left alone. With
``false`` each worker keeps its own optimizer state; only weights and buffers move.
Under compression, only first moments go through the codec (:data:`SIGNED_STATE`); the rest
of the state is averaged exactly.

Compression. With ``compression`` set, the worker's exchange sends each worker's weighted
change since the previous average, ``a_i (t_i - ref_t)``, compressed with error feedback
(:class:`sparkdl.comm.compression.collectives.CompressedAverage`): a worker sends the
compression factor less on top of ``1/tau``, and every worker still ends each average
with the same tensors.

Backup workers (``wa_backup_workers = b``; Chen et al.'s idea, applied to periods). A
period of ``tau`` local steps ends once the first ``N - b`` workers finished it: each
worker that trained every step of a period adds one to the period's counter in the
process group's store, and before each step a worker checks that counter (one small
round trip). A worker that finds the period over trains none of its remaining steps
(it consumes their batches, counted as ``skipped_steps``) and joins the average at the
period's last step with what it did train: its weight is its rows, so it pulls the
model proportionally less. Every rank still calls the same collectives in the same
order. From epoch 2 on only: epoch 1 streams from Spark with an all-reduce per step,
so no worker can run ahead of a straggler there. Unlike the parameter server's backup
workers, which skip steps already made without them, the rows of a cut-short period
are not trained by anyone.

Outer optimizer. With ``outer_optimizer = "nesterov"`` each round's average change is a
pseudo-gradient for Nesterov momentum SGD (DiLoCo; :mod:`sparkdl.strategies.outer`), run alike
on every worker after the average; its momentum goes into checkpoints. An average before the
round's last step (an epoch's validation, the end of training) is a plain one: the round's
change is then applied at its end, from the same start.

Streaming. With ``fragments > 1`` the parameters travel in fragments at staggered steps, each
fragment's sum overlapping ``fragment_delay`` steps of training (Streaming DiLoCo;
:mod:`sparkdl.strategies.streaming`); the whole model is averaged plainly at epoch ends and
checkpoints, the fragments' next rounds passing what was trained before through the outer
optimizer (their global weights go into checkpoints).

Hierarchy. With ``runtime.hierarchy`` the exchange sums each bucket within the host into
its leader, all-reduces it among the leaders and broadcasts it back
(:mod:`sparkdl.comm.hierarchy`): one model's worth crosses the network per host and average.

Frozen parameters. Parameters with ``requires_grad = False`` (a LoRA model's base) are in no
average, no outer step and no starting broadcast: they never change and every worker built
the same ones (:mod:`sparkdl.strategies.trainable`, which checks it once at build time), so
an average moves only the trainable parameters, the floating buffers and the optimizer state.

A user's own loop. The model comes back as it is; after every ``sync_every`` steps of
``ctx.batches`` the workers' weights, buffers and optimizer state are averaged, each
weighted by the rows its optimizer trained since the last average (an optimizer step
post-hook says which steps it took: :class:`_PeriodFace`). A worker whose rows ran out
takes no step: its weight in the next average is the rows it did train. ``ctx.state_dict``
between two averages averages first, so a checkpoint holds one point every worker resumes
from, not rank 0's drift.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sparkdl.comm.exchange import buckets
from sparkdl.comm.traffic import Pattern
from sparkdl.config import OuterOptimizer, SparkDLConfig, Strategy
from sparkdl.errors import ConfigError, PeerStopped, SparkDLError, agreed
from sparkdl.strategies import outer
from sparkdl.strategies.periods import period_ending
from sparkdl.strategies.rules import (
    refuse_backups_without_a_worker,
    refuse_compressed_hierarchy,
    refuse_powersgd,
)
from sparkdl.strategies.streaming import StreamingRounds
from sparkdl.strategies.trainable import agree_on_frozen, trainable_parameters
from sparkdl.training.own_loop import OwnLoopFace, RunningStep
from sparkdl.training.strategy import (
    StepInput,
    StepOutcome,
    StrategyContext,
    SyncStats,
    SyncStrategy,
    Verdict,
)

Named = tuple[str, torch.Tensor]

#: Optimizer state a lossy codec may carry: first moments, which take either sign. Every
#: other state (Adam's and Adagrad's sums of squares, which must stay positive, and whatever
#: an optimizer we do not know keeps) is averaged exactly: a compressed average adds decoded
#: changes to a reference, and for a second moment near zero that sum can be negative
#: (Adam's next step is then the square root of a negative number).
SIGNED_STATE = frozenset({"momentum_buffer", "exp_avg"})


class WeightAveragingStrategy(SyncStrategy):
    """w <- weighted mean_i(w_i) every ``sync_every`` steps; no traffic in between."""

    name = Strategy.WEIGHT_AVERAGING
    pattern = Pattern.RING_PERIODIC
    plain_sum = True
    serves_own_loop = True
    steps_together = False

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self._tau = ctx.config.weight_averaging.sync_every
        self._average_state = ctx.config.weight_averaging.average_optimizer_state
        self._bucket_bytes = int(ctx.config.runtime.bucket_cap_mb * 1024 * 1024)
        self._rows_since_sync = 0
        self._steps_since_sync = 0
        self._stopping: SparkDLError | None = None
        self._ending = period_ending(ctx)
        self._period = 0  # averages so far: the same count on every rank
        self._cut_short = False  # the period ended without this worker
        self._trained_throughout = True  # rows at every step of the period so far
        # a round's average cut short (a validation, a user's checkpoint): the outer optimizer's
        # reference is no longer the model's weights, and a checkpoint must carry it
        self._averaged_mid_round = outer.REFERENCE_KEY in ctx.resumed_state
        # what the averages move, decided once: the frozen parameters stay where model_fn put them
        self._trainable = trainable_parameters(ctx.module)
        agree_on_frozen(ctx.module, ctx.exchange, ctx.rank)
        for _, tensor in self._model_tensors():  # start from rank 0's weights, like DDP
            ctx.exchange.broadcast_(tensor, src=0)
        ctx.exchange.remember(list(self._model_tensors()))
        self._streaming = _streaming_rounds(ctx, ctx.resumed_state)
        self._outer = None if self._streaming else _outer_step(ctx, ctx.resumed_state)

    @classmethod
    def check_settings(cls, config: SparkDLConfig) -> None:
        every, tau = config.reliability.checkpoint_every, config.weight_averaging.sync_every
        if every and every % tau:
            raise ConfigError(
                f"checkpoint_every = {every} is not a multiple of sync_every = {tau}; weight averaging "
                "checkpoints right after an average, when every worker holds the same weights"
            )
        refuse_backups_without_a_worker(
            config,
            "wa_backup_workers",
            config.weight_averaging.wa_backup_workers,
            "each period ends once num_workers - wa_backup_workers workers finished it, so at least one must",
            "backup workers are not available with two-level averaging yet; set wa_backup_workers = 0 "
            "or hierarchy = 'none'",
        )
        refuse_powersgd(config)
        refuse_compressed_hierarchy(config)
        section = config.weight_averaging
        if section.fragments > 1 and section.wa_backup_workers:
            raise ConfigError(
                f"fragments = {section.fragments} (streaming) with wa_backup_workers = "
                f"{section.wa_backup_workers} is not available: a fragment's round needs every worker; "
                "set one of them back (fragments = 1 or wa_backup_workers = 0)"
            )

    @property
    def checkpoint_multiple(self) -> int:
        # Right after an average every worker holds the same weights: the only steps
        # at which one checkpoint (rank 0's) stands for all of them. Streaming averages the
        # whole model at each checkpoint step and epoch end itself.
        return 1 if self._streaming else self._tau

    def train_step(self, step: StepInput) -> StepOutcome:
        rows = 0
        loss = torch.zeros((), device=self.ctx.device)
        verdict = Verdict.APPLY
        cut_short = self._period_ended(step)
        if cut_short:  # a backup worker: the period ended without it
            self.stats.skipped_steps += 1 if step.batches else 0
        elif step.batches:  # a worker without rows only joins the averages
            loss = self._backward(step, step.batches, 1.0)  # each worker steps on its own mean loss
            verdict = self._judge(step, loss)
            if verdict is Verdict.APPLY:
                self._optimizer_step(step)
                rows = step.rows
            else:
                loss = torch.zeros((), device=self.ctx.device)
            self.ctx.optimizer.zero_grad(set_to_none=True)
        else:
            self._trained_throughout = False
        self.local_step_done(step.step, rows)
        return StepOutcome(loss, trained=not cut_short, nan_skipped=verdict is Verdict.NAN_SKIPPED)

    def own_loop(self, optimizer: torch.optim.Optimizer, step: RunningStep) -> OwnLoopFace:
        return _PeriodFace(self, optimizer, step)

    def average_now(self, rows_in_flight: int, inside_a_step: bool) -> None:
        """A user's loop asks for the model between two averages (every rank at the same
        point): average now, plainly, counting ``rows_in_flight`` (the rows of the step under
        way whose optimizer already stepped). Whether to is the same on every rank: steps
        since the last average, or a call inside a step (whose update may have moved this
        worker)."""
        if self._streaming is not None:
            self.finish()
            return
        if not (self._steps_since_sync or inside_a_step):
            return
        self._rows_since_sync += rows_in_flight
        self._end_period(full_round=False)

    def local_step_done(self, step: int, rows: int) -> None:
        """Global step ``step`` trained ``rows`` rows on this worker (0: none, or the step was
        skipped): average once ``tau`` steps are done. Every rank calls it at every step; a
        user's own loop calls it after each optimizer step (:mod:`sparkdl.worker.prepare`)."""
        self._rows_since_sync += rows
        self._steps_since_sync += 1
        if self._streaming is not None:
            self._streaming.step_done(step, rows, self._fragment_rows)
            every = self.ctx.config.reliability.checkpoint_every
            if every and (step + 1) % every == 0:  # the checkpoint after this step stands for all
                self.finish()
        elif (step + 1) % self._tau == 0:
            self._end_period(full_round=True)

    def finish(self) -> None:
        if self._streaming is not None:  # fragments in flight first, then the whole model
            self._streaming.drain()
            if self._steps_since_sync:
                self._average(full_round=False)
        elif self._steps_since_sync:  # a round cut short (validation, the end): averaged plainly
            self._end_period(full_round=False)

    def end_epoch(self) -> SyncStats:
        if self._streaming is not None:  # an epoch end may be checkpointed: one model first
            self.finish()
        return super().end_epoch()

    def _fragment_rows(self, rows: int) -> float:
        """The rows every worker trained since a fragment's last round."""
        total, _ = self._round_message(rows, 0)
        return total

    def _round_message(self, rows: int, state_values: int) -> tuple[float, list[int]]:
        """The one small sum before an average: the round's total rows and every rank's
        optimizer-state values; raises on every rank when one of them must stop."""
        round_ = RoundMessage(self.ctx.world_size)
        vector = round_.pack(self.ctx.rank, rows, self._stopping is not None, state_values, self.ctx.device)
        self.ctx.exchange.sum_(vector)
        total, stopped, states = round_.unpack(vector)
        if stopped:
            raise agreed(
                self._stopping
                or PeerStopped(f"rank {self.ctx.rank} stopped with rank(s) {stopped}, which failed")
            )
        return total, states

    def _period_ended(self, step: StepInput) -> bool:
        """Whether the period has ended without this worker: asked of the store before each
        step from epoch 2 on (epoch 1 steps in lockstep: nobody can be ahead)."""
        if not self._cut_short and step.epoch > 1:
            self._cut_short = self._ending.over(self._period)
        return self._cut_short

    def _end_period(self, full_round: bool) -> None:
        # A worker counts towards a period's quorum only when it trained all of it: one whose
        # rows ran out would otherwise end the period for the workers that still have rows.
        if self._trained_throughout and not self._cut_short:
            self._ending.finished(self._period)
        self._average(full_round)

    def _stop(self, error: SparkDLError) -> None:
        self._stopping = error  # raised on every rank at the next average

    def _average(self, full_round: bool) -> None:
        """Average every worker's weights (and state); after a full round of ``sync_every``
        steps, the outer optimizer steps on the round's change. A round cut short is averaged
        plainly: its change joins the next full round's, measured from the same start."""
        state = sum(t.numel() for _, (_, t) in self._optimizer_state()) if self._average_state else 0
        total, states = self._round_message(self._rows_since_sync, state)
        if self.ctx.rank == 0:  # every rank is past its last look at the period's counter: drop it
            self._ending.forget(self._period)
        # streaming: the fragments weigh the parameters by their own rounds' rows
        named: list[Named] = list(self._model_tensors() if self._streaming is None else self._buffers())
        exact: list[Named] = []  # averaged without a lossy codec
        if state > 0 and all(other == state for other in states):  # the same state everywhere
            for key, tensor_named in self._optimizer_state():
                (named if key in SIGNED_STATE else exact).append(tensor_named)
        if total > 0:
            weight = self._rows_since_sync / total
            exchange = self.ctx.exchange
            exchange.weighted_sum_(list(buckets(named, self._bucket_bytes)), weight)
            if exact:
                exchange.weighted_sum_(list(buckets(exact, self._bucket_bytes)), weight, lossless=True)
            if self._outer is not None and full_round:  # the round's change is a pseudo-gradient
                self._outer.step()
                exchange.remember(list(self._parameters()))  # the next changes start here
        if self._streaming is not None:
            self._streaming.average()
        self._averaged_mid_round = not full_round
        self.stats.sync_rounds += 1
        self._rows_since_sync = self._steps_since_sync = 0
        self._period += 1
        self._cut_short, self._trained_throughout = False, True

    def checkpoint_state(self, global_step: int) -> dict[str, Any]:
        if self._streaming is not None:
            return {
                outer.CHECKPOINT_KEY: self._streaming.velocity(),
                outer.REFERENCE_KEY: self._streaming.reference(),
            }
        if self._outer is None:
            return {}
        state = {outer.CHECKPOINT_KEY: self._outer.velocity()}
        if self._averaged_mid_round:  # a user's loop saves mid-round: the round's start is not the model
            state[outer.REFERENCE_KEY] = self._outer.reference()
        return state

    def rebase(self, resumed_state: Mapping[str, Any]) -> None:
        self.ctx.exchange.remember(list(self._model_tensors()))
        self._averaged_mid_round = outer.REFERENCE_KEY in resumed_state
        self._streaming = _streaming_rounds(self.ctx, resumed_state)
        self._outer = None if self._streaming else _outer_step(self.ctx, resumed_state)

    def _model_tensors(self) -> Iterator[Named]:
        yield from self._parameters()
        yield from self._buffers()

    def _buffers(self) -> Iterator[Named]:
        module = self.ctx.module
        yield from ((f"buffer {name}", b) for name, b in module.named_buffers() if b.is_floating_point())

    def _parameters(self) -> Iterator[Named]:
        """The trainable parameters (decided at build time): the frozen ones never change."""
        yield from ((f"parameter {name}", p.data) for name, p in self._trainable)

    def _optimizer_state(self) -> Iterator[tuple[str, Named]]:
        """Every floating state tensor of the optimizer, with its key (``exp_avg``, ...)."""
        optimizer = self.ctx.optimizer
        index = 0
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                for key in sorted(state):
                    value = state[key]
                    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                        yield key, (f"optimizer {index} {key}", value)
                index += 1


def _outer_step(ctx: StrategyContext, resumed_state: Mapping[str, Any]) -> outer.NesterovOuterStep | None:
    """DiLoCo's outer optimizer where ``outer_optimizer`` asks for it, from the model's weights
    as they stand, with the momentum of the checkpoint a run resumed from."""
    section = ctx.config.weight_averaging
    if section.outer_optimizer is OuterOptimizer.NONE:
        return None
    parameters = [p.data for _, p in trainable_parameters(ctx.module)]
    velocity = resumed_state.get(outer.CHECKPOINT_KEY)
    reference = resumed_state.get(outer.REFERENCE_KEY)
    return outer.NesterovOuterStep(parameters, section.outer_lr, section.outer_momentum, velocity, reference)


def _streaming_rounds(ctx: StrategyContext, resumed_state: Mapping[str, Any]) -> StreamingRounds | None:
    """The fragments, where ``fragments > 1`` asks for them; each with the outer optimizer (plain
    averaging: lr 1, momentum 0) and the momentum of the checkpoint a run resumed from."""
    section = ctx.config.weight_averaging
    if section.fragments <= 1:
        return None
    nesterov = section.outer_optimizer is OuterOptimizer.NESTEROV
    lr, momentum = (section.outer_lr, section.outer_momentum) if nesterov else (1.0, 0.0)
    named = [(f"parameter {name}", p.data) for name, p in trainable_parameters(ctx.module)]
    return StreamingRounds(
        named,
        section.fragments,
        section.sync_every,
        section.fragment_delay,
        section.fragment_mix,
        lambda tensors, velocity, reference: outer.NesterovOuterStep(
            tensors, lr, momentum, velocity, reference
        ),
        resumed_state.get(outer.CHECKPOINT_KEY),
        resumed_state.get(outer.REFERENCE_KEY),
        ctx.exchange,
        int(ctx.config.runtime.bucket_cap_mb * 1024 * 1024),
    )


@dataclass(frozen=True)
class RoundMessage:
    """The one small all-reduce (a sum) before an average: the rows of the round, which ranks
    must stop, and how many optimizer-state values each holds (the state is averaged only
    where every worker holds the same). Layout: ``[rows, stop flag of rank 0 .. rank N-1,
    state values of rank 0 .. rank N-1]`` (float64: exact for counts below 2**53)."""

    world_size: int

    def pack(
        self, rank: int, rows: int, stopping: bool, state_values: int, device: torch.device
    ) -> torch.Tensor:
        vector = torch.zeros(1 + 2 * self.world_size, dtype=torch.float64, device=device)
        vector[0] = float(rows)
        vector[1 + rank] = 1.0 if stopping else 0.0
        vector[1 + self.world_size + rank] = float(state_values)
        return vector

    def unpack(self, vector: torch.Tensor) -> tuple[float, list[int], list[int]]:
        """The round's total rows, the ranks that must stop, and every rank's state values."""
        values = vector.tolist()
        n = self.world_size
        stops = values[1 : 1 + n]
        return values[0], [r for r, flag in enumerate(stops) if flag], [int(v) for v in values[1 + n :]]


class _PeriodFace(OwnLoopFace):
    """A weight-averaged model's count toward its next average, in a user's own loop: the
    steps of ``ctx.batches`` (the same on every rank, whether its optimizer stepped or not:
    a skipped step, e.g. by an fp16 scaler, never puts the ranks out of step), and the rows
    its optimizer trained."""

    def __init__(
        self, strategy: WeightAveragingStrategy, optimizer: torch.optim.Optimizer, step: RunningStep
    ) -> None:
        super().__init__(strategy, optimizer, strategy.ctx.rank)
        self._strategy = strategy
        self._step = step
        self._stepped = False
        self._pending_rows = 0  # rows since the optimizer's last step (accumulated gradients)
        self._averaged_in_step = False  # the step under way's rows went into an average already
        self._asked = False  # averaged for a state asked since the last step: the same on every rank
        optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, *_: object) -> None:
        self._stepped = True

    def step_done(self, step: int, rows: int) -> None:
        self._pending_rows += rows
        trained = self._pending_rows if self._stepped else 0
        if self._stepped:
            self._pending_rows, self._stepped = 0, False
        if self._averaged_in_step:  # counted by the average asked for inside the step
            trained, self._pending_rows, self._averaged_in_step = 0, 0, False
        self._asked = False
        self._strategy.local_step_done(step, trained)

    def model_state(self) -> dict[str, Any]:
        """The averaged model: between two averages every worker holds its own drift, so the
        workers average first (a plain one, as before a validation; every rank calls this at
        the same point), and a checkpoint of it resumes every worker from one point."""
        self._average_now()
        return super().model_state()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        self._average_now()  # averaged with the weights (average_optimizer_state)
        return super().optimizer_state(optimizer)

    def _average_now(self) -> None:
        """Average for a state asked for, once until the next step (the model's and then the
        optimizer's state of one checkpoint cost one average, and count its rows once)."""
        if self._asked:
            return
        self._asked = True
        inside = self._step.inside
        in_flight = self._pending_rows + self._step.rows if inside and self._stepped else 0
        self._strategy.average_now(in_flight, inside)
        if in_flight:  # the step's update is in the average: its step_done counts no rows again
            self._averaged_in_step = True
