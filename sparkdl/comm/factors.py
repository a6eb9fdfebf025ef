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
from sparkdl.comm.traffic import factors_pay
from sparkdl.config import SufficientFactors
from sparkdl.errors import ConfigError, agreed


def factorable(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    """``module``'s fully connected layers whose weight gradient may travel as factors, with
    their weight's parameter name: every ``nn.Linear`` with a trainable weight that no other
    module holds (a weight an embedding or a second layer shares has a gradient that is no
    single layer's ``δᵀ x``). The worker and the parameter server find the same ones in the
    same model. An attention block's output projection is left out: ``nn.MultiheadAttention``
    uses its weight by a function, never calling the layer. Any other weight used outside its
    layer by a function (``x @ layer.weight``) is no module's to show:
    :meth:`Factors.sum_gradients` finds it at the first step."""
    holders: dict[int, int] = {}
    for sub in module.modules():
        for param in sub._parameters.values():
            if param is not None:
                holders[id(param)] = holders.get(id(param), 0) + 1
        if isinstance(sub, nn.MultiheadAttention):  # its out_proj is called as a function
            holders[id(sub.out_proj.weight)] = holders.get(id(sub.out_proj.weight), 0) + 1
    names = {id(p): name for name, p in module.named_parameters()}
    return [
        (names[id(sub.weight)], sub)
        for sub in module.modules()
        if isinstance(sub, nn.Linear) and sub.weight.requires_grad and holders[id(sub.weight)] == 1
    ]


#: How far (a share of the larger norm) autograd's gradient of a factored weight may be from
#: its rows' factors before the weight counts as used elsewhere: above the rounding of bf16 or
#: fp16 autocast and TF32 matmuls (about 1e-2 at worst), far below another use's share.
OTHER_USE_SHARE = 0.05


def other_uses(layers: Sequence[FactorLayer]) -> list[str]:
    """The layers whose weight's gradient, as autograd accumulated it on this worker, is not
    the sum of their own rows' factors: the weight is used elsewhere too (a function of it in
    the forward, a tie the modules do not show), and its factors would drop that share. A
    layer its forward never called, whose weight has a gradient all the same, counts."""
    found = []
    for layer in layers:
        grad = layer.module.weight.grad
        if grad is None:
            continue
        if not layer.rows:
            if bool(grad.abs().max() > 0):
                found.append(layer.name)
            continue
        x, delta = layer.factors()
        own, autograds = (delta.t() @ x).float(), grad.float()
        apart = float((autograds - own).norm())
        if apart > OTHER_USE_SHARE * max(float(autograds.norm()), float(own.norm())) + 1e-12:
            found.append(layer.name)
    return found


@dataclass
class FactorLayer:
    """One fully connected layer whose gradient may travel as factors, and the rows its
    backward passes left since they were last taken."""

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

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row kept, as (x: rows x inputs, δ: rows x outputs) in the weight's dtype."""
        dtype = self.module.weight.dtype
        if not self.rows:
            weight = self.module.weight
            return weight.new_zeros(0, self.inputs), weight.new_zeros(0, self.outputs)
        return (
            torch.cat([x.to(dtype) for x, _ in self.rows]),
            torch.cat([delta.to(dtype) for _, delta in self.rows]),
        )


class FactorCapture:
    """Keeps the factors of ``layers``: a forward hook on each layer keeps its input and
    registers a hook on its output for the gradient there. Inference (no gradient) keeps
    nothing; a layer called twice in one forward keeps the rows of both calls."""

    def __init__(self, layers: Sequence[tuple[str, nn.Linear]]) -> None:
        self.layers = [FactorLayer(name, module) for name, module in layers]
        self._handles: list[RemovableHandle] = [
            layer.module.register_forward_hook(self._capture(layer)) for layer in self.layers
        ]

    @staticmethod
    def _capture(layer: FactorLayer) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
                return  # inference: no backward will come
            x = inputs[0].detach().reshape(-1, layer.inputs)

            def keep(delta: torch.Tensor) -> None:
                layer.rows.append((x, delta.detach().reshape(-1, layer.outputs)))

            output.register_hook(keep)

        return hook

    def clear(self) -> None:
        for layer in self.layers:
            layer.rows.clear()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


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
        taken = [
            (name, layer)
            for name, layer in factorable(module)
            if not self._auto or factors_pay(rows_hint, layer.in_features, layer.out_features, world)
        ]
        self._capture = FactorCapture(taken)
        self._layers = self._capture.layers
        self._checked = False  # the first step compares the factors with autograd's gradient

    @property
    def weight_names(self) -> list[str]:
        """The parameters whose gradients this object sums (for DDP to leave out)."""
        return [layer.name for layer in self._layers]

    def sum_gradients(self) -> None:
        """Set every taken layer's weight gradient to the mean over the workers, from everyone's
        factors (or, in ``auto``, the layers they do not pay for this step, from a sum of the
        matrices). Every worker calls it after the step's last backward; clears the capture."""
        if not self._layers:
            return
        if not self._checked:
            self._check_single_use()
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
        self._capture.clear()

    def _check_single_use(self) -> None:
        """At the first step, every worker compares each taken layer's factors with the
        gradient autograd accumulated for its weight, and all stop together when one found
        another use.

        Raises:
            ConfigError: naming the layers (agreed: every worker raises it).
        """
        self._checked = True
        found = other_uses(self._layers)
        flags = torch.tensor([float(layer.name in found) for layer in self._layers], dtype=torch.float64)
        self._exchange.sum_control_(flags)
        shared = [layer.name for layer, flag in zip(self._layers, flags.tolist(), strict=True) if flag]
        if shared:
            raise agreed(
                ConfigError(
                    f"sufficient_factors: the weight of {shared} is used outside its nn.Linear (a "
                    "function of it in the forward, or a tie), so its gradient is not its rows' "
                    "factors; set sufficient_factors = 'off', or use the weight only through its layer"
                )
            )

    def _sum_matrices(self, layers: Sequence[FactorLayer]) -> None:
        if not layers:
            return
        bucket = []
        for layer in layers:
            weight = layer.module.weight
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            bucket.append((layer.name, weight.grad))
        self._exchange.weighted_sum_([bucket], 1.0 / self._exchange.world_size, lossless=True)

    def _sum_factors(self, chosen: Sequence[tuple[int, FactorLayer]], every: torch.Tensor) -> None:
        """Gather the chosen layers' factors from every worker and rebuild their mean gradient.
        A worker's flat holds, layer after layer, its rows' inputs then their output gradients."""
        pieces = []
        for _, layer in chosen:
            x, delta = layer.factors()
            pieces += [x.reshape(-1), delta.reshape(-1)]
        own = torch.cat(pieces)
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
        self._capture.close()
