"""An optimizer's state keyed by parameter name, and back.

``torch.optim.Optimizer.state_dict()`` numbers parameters by their position in its param
groups. A strategy that holds a slice of the model (fsdp's shards, a pipeline's stage)
numbers them differently from the whole model; checkpoints number them as the whole model's
optimizer would, so that one resume path reads every strategy's. Names bridge the two.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter the optimizer holds, in its order (the numbering of
    ``optimizer.state_dict()``)."""
    names = {id(p): name for name, p in module.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def named_to_indexed(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name, keyed by position in ``names`` instead."""
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]
        ],
    }


def indexed_to_named(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`named_to_indexed`."""
    return {
        "state": {names[int(i)]: value for i, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[int(i)] for i in group["params"]]} for group in state["param_groups"]
        ],
    }
