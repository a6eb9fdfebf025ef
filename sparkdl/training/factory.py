"""Building the model, optimizer and loss a worker trains with, from the user's spec."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable

import torch
from torch import nn

from sparkdl.config import OptimizerConfig, OptimizerName
from sparkdl.errors import ConfigError

ModelFn = Callable[[], nn.Module]
OptimizerFn = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def build_model(model_fn: ModelFn) -> nn.Module:
    """Call ``model_fn`` and check it returned a module."""
    module = model_fn()
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"model_fn returned {type(module).__name__}, not a torch.nn.Module; "
            "model_fn must build and return the model"
        )
    return module


def cpu_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state as detached CPU tensors (what checkpoints and results carry)."""
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def state_to_bytes(module: nn.Module) -> bytes:
    """The module's state as ``torch.save`` bytes: tensors only, loadable with weights_only."""
    buffer = io.BytesIO()
    torch.save(cpu_state_dict(module), buffer)
    return buffer.getvalue()


def state_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """Load :func:`state_to_bytes` output; refuses anything but tensors (``weights_only``)."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def build_optimizer(
    params: Iterable[nn.Parameter], optimizer_fn: OptimizerFn | None, config: OptimizerConfig
) -> torch.optim.Optimizer:
    """``optimizer_fn(params)`` if given, else the optimizer named by ``[optimizer]``."""
    if optimizer_fn is not None:
        optimizer = optimizer_fn(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer_fn returned {type(optimizer).__name__}, not a torch.optim.Optimizer"
            )
        return optimizer
    name = config.optimizer
    if name is OptimizerName.SGD:
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    if name is OptimizerName.ADAM:
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    if name is OptimizerName.ADAMW:
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.Adagrad(params, lr=config.lr, weight_decay=config.weight_decay)
