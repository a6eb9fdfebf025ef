"""Streaming DiLoCo (Douillard et al., 2025): the model's parameters in fragments, each
averaged every ``sync_every`` local steps at its own offset, its average allowed to travel
while training goes on.

Fragments. The parameters, in the model's order, are cut into ``fragments`` runs of about
equal bytes. Fragment ``p`` is sent at the steps ``s`` with ``(s + 1 + p * tau // F) % tau ==
0`` (``tau = sync_every``, ``F = fragments``): the fragments take turns, so one fragment's worth
of the model crosses the network at a time instead of the whole model every ``tau`` steps (the
same bytes in all, a ``F``-th of the peak).

A fragment's round. At its send step every worker tells the others the rows it trained since
the fragment's last round (one small sum, which also carries a worker's stop), then sends
``a_i w_i`` for the fragment (``a_i``: its share of those rows). ``fragment_delay = d`` steps
later the sum has arrived; every worker then applies the outer optimizer to it, from the
fragment's *global* weights (the result of its previous round, the same on every worker):
``g <- outer(g, average)``, and merges: ``w <- mix * w + (1 - mix) * g`` (``fragment_mix``: the
share of the worker's own progress kept, Streaming DiLoCo's alpha). With ``d = 0`` and
``mix = 0`` each fragment is DiLoCo's round, and with one fragment it is the plain
strategy's (tested bit for bit).

The sum travels as an asynchronous all-reduce on the process group where the exchange is
plain gloo or NCCL: the next ``d`` steps' compute overlaps it. Through a compressed,
shared-memory or two-level exchange it is made at the send step and held until the
delay is over: the same values, without the overlap.

Full averages. Before a checkpoint, a validation and at every epoch end (and at the end of
training) every fragment still in flight is applied and the whole model, buffers and, with
``average_optimizer_state``, the optimizer state are averaged plainly, as plain DiLoCo
averages a round cut short: each fragment weighted by the rows each worker trained since the
fragment's last round (what the workers' copies differ by), the rest by the rows since the
previous full average. Each fragment's global weights stay where its last round left them:
its next round measures its change from there, so what was trained before the full average
still reaches the model through the outer optimizer, with its momentum (restarting the
fragments there would pass it at outer lr 1 without momentum, and with epochs shorter than
``sync_every`` the outer optimizer would see little of training). A checkpoint carries the
fragments' global weights with their momentum: written when every worker holds the same
weights, it resumes the run exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sparkdl.comm.exchange import Exchange, PendingSum, buckets
from sparkdl.strategies.outer import NesterovOuterStep

Named = tuple[str, torch.Tensor]


def cut_into_fragments(named: Sequence[Named], fragments: int) -> list[list[Named]]:
    """``named`` (the parameters, in order) as ``fragments`` consecutive runs of about equal
    bytes; never an empty one (at most one fragment per tensor)."""
    count = min(fragments, len(named))
    total = sum(t.numel() * t.element_size() for _, t in named)
    runs: list[list[Named]] = [[]]
    seen = 0
    for index, (name, tensor) in enumerate(named):
        unopened = count - len(runs)
        full = seen * count >= len(runs) * total  # this run has its share of the bytes
        if runs[-1] and unopened and (full or len(named) - index <= unopened):
            runs.append([])
        runs[-1].append((name, tensor))
        seen += tensor.numel() * tensor.element_size()
    return runs


def send_offset(fragment: int, fragments: int, tau: int) -> int:
    """How many steps before the end of each ``tau``-step period fragment ``fragment`` is sent."""
    return fragment * tau // fragments


@dataclass
class _InFlight:
    """A fragment's sum on its way, and the global step at whose end it is applied."""

    pending: PendingSum
    due: int


@dataclass
class Fragment:
    """One fragment: its parameters, their global weights and outer momentum, and the rows
    this worker trained since the fragment's last round."""

    named: list[Named]
    outer: NesterovOuterStep
    offset: int
    rows: int = 0
    in_flight: _InFlight | None = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for _, t in self.named]


#: ``rows -> the total rows of every worker``: the small sum before a fragment is sent (which
#: raises on every rank when one of them must stop).
RowsSum = Callable[[int], float]


class StreamingRounds:
    """The fragments of one worker and their schedule (see the module's text).

    Args:
        named: the model's parameters, in order (changed in place).
        fragments: how many fragments.
        tau: ``sync_every``: the steps between two rounds of a fragment.
        delay: ``fragment_delay``: the steps a sum may travel before it is applied.
        mix: ``fragment_mix``: the share of the worker's own weights kept at a merge.
        outer: ``(tensors, velocity) -> NesterovOuterStep`` for a fragment's tensors (lr 1 and
            momentum 0 for plain averaging).
        velocity: the checkpoint's outer momentum, one CPU tensor per parameter, or None.
        reference: the checkpoint's global weights, one CPU tensor per parameter, or None (the
            parameters as they stand).
        exchange: the worker's exchange.
        bucket_bytes: the largest piece of a fragment sent as one sum.
    """

    def __init__(
        self,
        named: Sequence[Named],
        fragments: int,
        tau: int,
        delay: int,
        mix: float,
        outer: Callable[
            [list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor] | None], NesterovOuterStep
        ],
        velocity: Sequence[torch.Tensor] | None,
        reference: Sequence[torch.Tensor] | None,
        exchange: Exchange,
        bucket_bytes: int,
    ) -> None:
        self._tau, self._delay, self._mix = tau, delay, mix
        self._exchange = exchange
        self._bucket_bytes = bucket_bytes
        runs = cut_into_fragments(named, fragments)
        self.fragments: list[Fragment] = []
        start = 0
        for index, run in enumerate(runs):
            moments = list(velocity[start : start + len(run)]) if velocity is not None else None
            globals_ = list(reference[start : start + len(run)]) if reference is not None else None
            tensors = [t for _, t in run]
            step = outer(tensors, moments, globals_)
            self.fragments.append(Fragment(run, step, send_offset(index, len(runs), tau)))
            start += len(run)

    def step_done(self, step: int, rows: int, total_rows: RowsSum) -> None:
        """Global step ``step`` trained ``rows`` rows here: send the fragments due, then apply
        those whose delay is over (a fragment sent with no delay is applied at once)."""
        for fragment in self.fragments:
            fragment.rows += rows
            if (step + 1 + fragment.offset) % self._tau == 0:
                self._send(fragment, step, total_rows)
        for fragment in self.fragments:
            if fragment.in_flight is not None and fragment.in_flight.due == step:
                self._apply(fragment)

    def drain(self) -> None:
        """Apply every fragment still in flight (before a full average)."""
        for fragment in self.fragments:
            if fragment.in_flight is not None:
                self._apply(fragment)

    def average(self) -> None:
        """The parameters' share of a full average (after :meth:`drain`; every worker calls it
        at the same point): each fragment weighted by the rows each worker trained since the
        fragment's last round (after a round with ``mix = 0`` the workers differ by those rows'
        progress only; where nobody trained since, a plain mean). Each fragment's global weights
        stay, so its next round passes all its change since its last one through the outer
        optimizer, as plain DiLoCo does after a round cut short."""
        rows = torch.tensor([float(f.rows) for f in self.fragments], dtype=torch.float64)
        self._exchange.sum_control_(rows)  # one small sum for every fragment
        for fragment, total in zip(self.fragments, rows.tolist(), strict=True):
            weight = fragment.rows / total if total > 0 else 1.0 / self._exchange.world_size
            self._exchange.weighted_sum_(list(buckets(fragment.named, self._bucket_bytes)), weight)
            fragment.rows = 0

    def velocity(self) -> list[torch.Tensor]:
        """The outer momentum of every parameter, in order (CPU tensors)."""
        return [v for fragment in self.fragments for v in fragment.outer.velocity()]

    def reference(self) -> list[torch.Tensor]:
        """The global weights of every parameter, in order (float32 CPU tensors)."""
        return [r for fragment in self.fragments for r in fragment.outer.reference()]

    def _send(self, fragment: Fragment, step: int, total_rows: RowsSum) -> None:
        total = total_rows(fragment.rows)
        weight = fragment.rows / total if total > 0 else 0.0
        fragment.rows = 0
        if total <= 0:  # nobody trained since its last round: nothing to send
            return
        copies = [(name, t.detach().float().clone()) for name, t in fragment.named]
        pending = self._exchange.start_weighted_sum(list(buckets(copies, self._bucket_bytes)), weight)
        fragment.in_flight = _InFlight(pending, step + self._delay)

    def _apply(self, fragment: Fragment) -> None:
        in_flight = fragment.in_flight
        assert in_flight is not None
        fragment.in_flight = None
        average = in_flight.pending.wait()
        offset = 0
        averages = []
        for tensor in fragment.tensors:
            averages.append(average[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
        merged = fragment.outer.step_from(averages)
        with torch.no_grad():
            for tensor, new in zip(fragment.tensors, merged, strict=True):
                if self._mix:  # in float32: a bf16 model's weights are rounded once, at the copy
                    tensor.copy_(new.lerp(tensor.float(), self._mix))
                else:
                    tensor.copy_(new)
        self._exchange.remember(
            [(name, g) for (name, _), g in zip(fragment.named, fragment.outer.globals, strict=True)]
        )
