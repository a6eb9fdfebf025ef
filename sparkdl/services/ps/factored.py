"""Pushes whose fully connected layers travel as sufficient factors; the server rebuilds them.

Project Adam's workers sent the parameter server each row's activation and error vectors
instead of a layer's gradient matrix, and the server formed the matrix itself. A push in
encoding :data:`FACTORS` does that for the shard's factorable weights
(:func:`sparkdl.comm.factors.factorable`, the same on the worker and the server, which build
the same model). Its payload:

    int32   one count per factorable weight of the shard, in the shard's order:
            r >= 0, the weight travels as r rows of factors; -1, as its matrix (below)
    float32 every value of the shard that travels whole, in the shard's order
    float32 for each weight with r >= 0, in order: its r inputs (r x M), then its r output
            gradients (r x N), already weighted as the whole values are (by rows, clipping)

The server rebuilds ``δᵀ x`` for each such weight and goes on as with a float32 push. A
worker sends a weight's factors only when they are fewer values than its matrix, so a push
is never larger than the plain one by more than its counts; the server refuses a count
past that, which bounds the rebuilding a push can ask of it (``r M N`` multiply-adds for
``r (M + N) < M N``) to what an honest push may.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from sparkdl.comm.traffic import fewer_values

#: A push's encoding (the frame's dtype field) when it carries factors; the codecs use 2-5.
FACTORS = 9


class EncodedPush(NamedTuple):
    """One shard's push payload in an encoding other than float32 (the frame's dtype and bytes)."""

    code: int
    data: torch.Tensor  # uint8


@dataclass(frozen=True)
class FactorLayout:
    """One shard's parameters as a push lays them out.

    Attributes:
        sizes: every parameter's number of values, in the shard's order.
        shapes: each parameter's (inputs M, outputs N) if it is a factorable weight, else None.
    """

    sizes: tuple[int, ...]
    shapes: tuple[tuple[int, int] | None, ...]

    @classmethod
    def of(cls, params: Sequence[nn.Parameter], factorable: Mapping[int, tuple[int, int]]) -> FactorLayout:
        """The layout of a shard of ``params``; ``factorable`` maps a weight's id to (M, N)."""
        return cls(tuple(p.numel() for p in params), tuple(factorable.get(id(p)) for p in params))

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def factorable(self) -> list[int]:
        """The positions of the factorable weights in the shard."""
        return [i for i, shape in enumerate(self.shapes) if shape is not None]

    def encode(
        self, whole: torch.Tensor, factors: Mapping[int, tuple[torch.Tensor, torch.Tensor]]
    ) -> EncodedPush:
        """The payload of a push: ``whole`` is the shard's flat float32 gradient (every value),
        ``factors`` the (x, δ) of the positions that travel as factors instead."""
        counts = [int(factors[i][0].shape[0]) if i in factors else -1 for i in self.factorable]
        pieces: list[torch.Tensor] = []
        offset = 0
        for i, size in enumerate(self.sizes):
            if i not in factors:
                pieces.append(whole[offset : offset + size])
            offset += size
        for i in self.factorable:
            if i in factors:
                x, delta = factors[i]
                pieces += [x.float().reshape(-1), delta.float().reshape(-1)]
        header = torch.tensor(counts, dtype=torch.int32).view(torch.uint8)
        return EncodedPush(FACTORS, torch.cat([header, *(p.view(torch.uint8) for p in pieces)]))

    def max_extra_bytes(self) -> int:
        """The most a push in this encoding may exceed the plain one by: its counts."""
        return 4 * len(self.factorable)

    def decode(self, data: torch.Tensor) -> torch.Tensor:
        """The shard's flat float32 gradient from a payload of :meth:`encode`.

        Raises:
            ValueError: the payload is malformed (a count below -1 or of no fewer values than
                its matrix, or its size is not the one its counts give).
        """
        positions = self.factorable
        head = 4 * len(positions)
        if data.numel() < head or data.numel() % 4:
            raise ValueError(
                f"{data.numel()} bytes cannot hold the {len(positions)} counts and float32 values"
            )
        counts = data[:head].view(torch.int32).tolist()
        if any(c < -1 for c in counts):
            raise ValueError(f"row counts {counts} below -1")
        rows = dict(zip(positions, counts, strict=True))
        for i, r in rows.items():  # a worker sends factors only where they are smaller than the matrix:
            m, n = self.shapes[i] or (0, 0)  # so no push makes the server rebuild more than that
            if not fewer_values(r, m, n):
                raise ValueError(
                    f"{r} rows of factors for a {n} x {m} weight: no fewer values than its matrix"
                )
        whole_values = sum(size for i, size in enumerate(self.sizes) if rows.get(i, -1) < 0)
        factor_values = 0
        for i, r in rows.items():
            shape = self.shapes[i]
            assert shape is not None
            factor_values += max(r, 0) * (shape[0] + shape[1])
        expected = head + 4 * (whole_values + factor_values)
        if data.numel() != expected:
            raise ValueError(f"{data.numel()} bytes where its counts {counts} give {expected}")
        values = data[head:].view(torch.float32)
        out = torch.empty(self.numel)
        offset = cursor = 0
        places = []
        for i, size in enumerate(self.sizes):
            if rows.get(i, -1) < 0:
                out[offset : offset + size] = values[cursor : cursor + size]
                cursor += size
            else:
                places.append((i, offset))
            offset += size
        for i, at in places:
            shape = self.shapes[i]
            assert shape is not None
            m, n, r = shape[0], shape[1], rows[i]
            x = values[cursor : cursor + r * m].view(r, m)
            delta = values[cursor + r * m : cursor + r * (m + n)].view(r, n)
            cursor += r * (m + n)
            out[at : at + m * n] = (delta.t() @ x).reshape(-1)
        return out
