"""A parameter-server worker's sufficient factors between two pushes.

The worker keeps adding its whole gradient to the push as before; beside it, the factors
(each row's input and output gradient) of its fully connected layers, weighted the same
way. At the push each such layer goes as its factors when they are fewer bytes than its
matrix (:func:`~sparkdl.comm.traffic.fewer_values`), else as the matrix; the server rebuilds the same sum
(:mod:`sparkdl.services.ps.factored`). With several steps per push (``push_every``) the
factors of every step go, so they pay only while the rows stay few.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from sparkdl.comm.factors import FactorCapture, factorable, other_uses
from sparkdl.comm.traffic import fewer_values
from sparkdl.services.ps.client import Gradient
from sparkdl.services.ps.factored import FactorLayout


class FactorPushes:
    """The factors of ``module``'s fully connected layers, kept for the next push.

    Args:
        module: the worker's model.
        shards: its parameters, shard by shard, as the server splits them.
    """

    def __init__(self, module: nn.Module, shards: Sequence[Sequence[nn.Parameter]]) -> None:
        layers = factorable(module)
        shapes = {id(layer.weight): (layer.in_features, layer.out_features) for _, layer in layers}
        self._capture = FactorCapture(layers)
        self.layouts = [FactorLayout.of(shard, shapes) for shard in shards]
        where = {id(p): (s, i) for s, shard in enumerate(shards) for i, p in enumerate(shard)}
        self._where = [where[id(layer.module.weight)] for layer in self._capture.layers]
        self._pending: list[dict[int, list[tuple[torch.Tensor, torch.Tensor]]]] = [{} for _ in shards]
        self._checked = False

    def used_elsewhere(self) -> list[str]:
        """At this worker's first step with rows (the caller's; before clipping changes the
        gradients): the layers whose weight autograd's gradient shows used outside the layer,
        whose factors would drop that share (:func:`~sparkdl.comm.factors.other_uses`); none
        after."""
        if self._checked:
            return []
        self._checked = True
        return other_uses(self._capture.layers)

    def add(self, weight: float) -> None:
        """The step's gradients were added to the push with ``weight`` (its rows, times the
        clipping's factor): add its factors with the same weight."""
        for layer, (shard, position) in zip(self._capture.layers, self._where, strict=True):
            if layer.rows:
                x, delta = layer.factors()
                self._pending[shard].setdefault(position, []).append((x.cpu(), (delta * weight).cpu()))
        self._capture.clear()

    def drop(self) -> None:
        """The step's gradients were not added (a skipped step): forget its factors."""
        self._capture.clear()

    def encode(self, whole: Sequence[torch.Tensor]) -> list[Gradient]:
        """Each shard's push: ``whole`` (its flat gradient) where no layer's factors are
        smaller than its matrix, else the encoding that carries them."""
        pushes: list[Gradient] = []
        for layout, flat, pending in zip(self.layouts, whole, self._pending, strict=True):
            chosen = {}
            for position, chunks in pending.items():
                shape = layout.shapes[position]
                assert shape is not None
                if fewer_values(sum(x.shape[0] for x, _ in chunks), *shape):  # joined only when sent
                    chosen[position] = (torch.cat([x for x, _ in chunks]), torch.cat([d for _, d in chunks]))
            pushes.append(layout.encode(flat, chosen) if chosen else flat)
        return pushes

    def pushed(self) -> None:
        """What was kept went with a push (or was dropped with it)."""
        for pending in self._pending:
            pending.clear()

    def close(self) -> None:
        self._capture.close()
