"""Small ready-made models for the bundled jobs and examples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class MLPFactory:
    """A picklable ``model_fn`` building a multi-layer perceptron.

    Args:
        input_dim: number of input features.
        hidden: sizes of the hidden layers.
        output_dim: number of outputs (classes for a classifier).
        dropout: dropout after each hidden layer (0 disables).
    """

    input_dim: int
    hidden: Sequence[int]
    output_dim: int
    dropout: float = 0.0

    def __call__(self) -> nn.Module:
        layers: list[nn.Module] = []
        width = self.input_dim
        for size in self.hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            if self.dropout:
                layers.append(nn.Dropout(self.dropout))
            width = size
        layers.append(nn.Linear(width, self.output_dim))
        return nn.Sequential(*layers)
