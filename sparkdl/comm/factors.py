"""Sufficient factors: a fully connected layer's gradient sent as the rows it is made of.

Over a batch, the gradient of ``y = x Wᵀ + b`` is ``dL/dW = δᵀ x``: a sum of one outer product
per row, of the row's input ``x_i`` (M numbers) and the gradient at its output ``δ_i`` (N
numbers). So instead of the N x M matrix a worker can send its B rows of ``x`` and ``δ``,
B (M + N) numbers, and every worker rebuilds the exact sum over every worker's rows from
everyone's factors (Poseidon's sufficient factor broadcasting; Project Adam's workers sent the
same vectors to the server). For a 4096 x 4096 layer at 32 rows a worker that is 1/64 of the
matrix.

What each costs one worker, with P workers: the factors go round a ring all-gather,
``(P - 1) B (M + N)`` numbers sent; the matrix round a ring all-reduce, ``2 (P - 1) M N / P``.
So factors pay when ``P B (M + N) < 2 M N`` (with two workers Poseidon's ``B (M + N) < M N``).
``auto`` decides it per layer and step from the step's largest row count over the workers;
every worker decides alike. A layer that factors do not pay for keeps its matrix: within DDP's
buckets when they never pay at the configured batch size, else summed after backward.

Every worker rebuilds the same sum from the same factors in the same order, so on workers of
one CPU or GPU type their weights stay identical, as after an all-reduce; on a mix of CPU
types the rebuilt sums may differ in the last bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from sparkdl.comm.exchange import Exchange
from sparkdl.config import SufficientFactors


def factors_pay(rows: int, inputs: int, outputs: int, world: int) -> bool:
    """Whether ``rows`` rows of factors cost one worker fewer bytes than the ``outputs x inputs``
    matrix: a ring all-gather of ``rows (inputs + outputs)`` per worker against a ring all-reduce
    of ``inputs outputs`` (module docstring)."""
    return world > 1 and world * rows * (inputs + outputs) < 2 * inputs * outputs


@dataclass
class _Layer:
    """One fully connected layer whose gradient may travel as factors, and its captured rows."""

    name: str  # its weight's parameter name
    module: nn.Linear
    rows: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (x, δ) per backward

    @property
    def inputs(self) -> int:
        return self.module.in_features

    @property
    def outputs(self) -> int:
        return self.module.out_features

    def row_count(self) -> int:
        return sum(x.shape[0] for x, _ in self.rows)


class Factors:
    """Captures the factors of ``module``'s fully connected layers and sums their gradients.

    Built before DDP wraps the module: the layers it takes are left out of DDP's buckets
    (:attr:`weight_names`); their biases stay in them. After each step's backward every worker
    calls :meth:`sum_gradients`, which leaves each taken layer's weight gradient as DDP would
    have: the mean over the workers of their (loss-scaled) gradients.

    Args:
        module: the bare model.
        exchange: the worker's exchange; the factors go through its :meth:`Exchange.gather_`.
        mode: ``on`` (every layer, every step) or ``auto``.
        rows_hint: the rows of a step on one worker (``batch_size x accumulate_steps``): in
            ``auto`` the layers factors cannot pay for at that count stay in DDP's buckets.
    """

    def __init__(
        self, module: nn.Module, exchange: Exchange, mode: SufficientFactors, rows_hint: int
    ) -> None:
        self._exchange = exchange
        self._auto = mode is SufficientFactors.AUTO
        world = exchange.world_size
        owners: dict[int, int] = {}
        for sub in module.modules():
            if isinstance(sub, nn.Linear):
                owners[id(sub.weight)] = owners.get(id(sub.weight), 0) + 1
        names = {id(p): name for name, p in module.named_parameters()}
        self._layers: list[_Layer] = []
        for sub in module.modules():
            weight = getattr(sub, "weight", None)
            if not isinstance(sub, nn.Linear) or weight is None or not weight.requires_grad:
                continue
            if owners[id(weight)] > 1:  # shared weights: their gradient is no single layer's δᵀx
                continue
            if self._auto and not factors_pay(rows_hint, sub.in_features, sub.out_features, world):
                continue
            self._layers.append(_Layer(names[id(weight)], sub))
        self._handles: list[RemovableHandle] = [
            layer.module.register_forward_hook(self._capture(layer)) for layer in self._layers
        ]

    @property
    def weight_names(self) -> list[str]:
        """The parameters whose gradients this object sums (for DDP to leave out)."""
        return [layer.name for layer in self._layers]

    @staticmethod
    def _capture(layer: _Layer) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
                return  # inference: no backward will come
            x = inputs[0].detach().reshape(-1, layer.inputs)

            def keep(delta: torch.Tensor) -> None:
                layer.rows.append((x, delta.detach().reshape(-1, layer.outputs)))

            output.register_hook(keep)

        return hook

    def sum_gradients(self) -> None:
        """Set every taken layer's weight gradient to the mean over the workers, from everyone's
        factors (or, in ``auto``, the layers they do not pay for this step, from a sum of the
        matrices). Every worker calls it after the step's last backward; clears the capture."""
        if not self._layers:
            return
        world = self._exchange.world_size
        counts = torch.tensor([layer.row_count() for layer in self._layers], dtype=torch.int64)
        every = self._exchange.gather_control(counts)  # [world, layers]
        most = every.max(dim=0).values.tolist()
        factored = [
            not self._auto or factors_pay(rows, layer.inputs, layer.outputs, world)
            for layer, rows in zip(self._layers, most, strict=True)
        ]
        self._sum_matrices([layer for layer, f in zip(self._layers, factored, strict=True) if not f])
        chosen = [(i, layer) for i, (layer, f) in enumerate(zip(self._layers, factored, strict=True)) if f]
        if chosen:
            self._sum_factors(chosen, every)
        for layer in self._layers:
            layer.rows.clear()

    def _sum_matrices(self, layers: Sequence[_Layer]) -> None:
        if not layers:
            return
        bucket = []
        for layer in layers:
            weight = layer.module.weight
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            bucket.append((layer.name, weight.grad))
        self._exchange.weighted_sum_([bucket], 1.0 / self._exchange.world_size, lossless=True)

    def _sum_factors(self, chosen: Sequence[tuple[int, _Layer]], every: torch.Tensor) -> None:
        """Gather the chosen layers' factors from every worker and rebuild their mean gradient.
        A worker's flat holds, layer after layer, its rows' inputs then their output gradients."""
        dtype = chosen[0][1].module.weight.dtype
        pieces = []
        for _, layer in chosen:
            pieces += [x.to(dtype).reshape(-1) for x, _ in layer.rows]
            pieces += [delta.to(dtype).reshape(-1) for _, delta in layer.rows]
        own = torch.cat(pieces) if pieces else chosen[0][1].module.weight.new_zeros(0)
        widths = [layer.inputs + layer.outputs for _, layer in chosen]
        lengths = [sum(int(row[i]) * w for (i, _), w in zip(chosen, widths, strict=True)) for row in every]
        flats = self._exchange.gather_(own, lengths)
        xs: list[list[torch.Tensor]] = [[] for _ in chosen]
        deltas: list[list[torch.Tensor]] = [[] for _ in chosen]
        for rank, flat in enumerate(flats):
            offset = 0
            for j, (i, layer) in enumerate(chosen):
                rows = int(every[rank, i])
                xs[j].append(flat[offset : offset + rows * layer.inputs].view(rows, layer.inputs))
                offset += rows * layer.inputs
                deltas[j].append(flat[offset : offset + rows * layer.outputs].view(rows, layer.outputs))
                offset += rows * layer.outputs
        for j, (_, layer) in enumerate(chosen):
            x, delta = torch.cat(xs[j]), torch.cat(deltas[j])  # every worker's rows, in rank order
            gradient = (delta.t() @ x).div_(self._exchange.world_size)
            weight = layer.module.weight
            if weight.grad is None:
                weight.grad = gradient
            else:
                weight.grad.copy_(gradient)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
