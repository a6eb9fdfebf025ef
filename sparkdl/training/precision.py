"""Precision: how a step's numbers are represented, as one piece the loop and the strategy share.

``training.precision`` picks it: ``fp32`` (nothing changes), ``bf16`` (the forward and loss
under autocast; the weights, gradients and optimizer stay float32) or ``fp16`` (autocast too,
and a gradient scaler: the loss is scaled before backward so small gradients survive fp16,
the gradients unscaled before clipping and the step, and a step whose scaled gradients
overflowed is skipped while the scale comes down). The loop runs the forward under
:meth:`Precision.autocast`; the strategy runs backward and the optimizer step through the
rest, so both sides agree by construction (Lightning Fabric's ``Precision`` plugin).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from sparkdl.config import Precision as PrecisionSetting
from sparkdl.training.guards import grads_finite

_AUTOCAST = {PrecisionSetting.BF16: torch.bfloat16, PrecisionSetting.FP16: torch.float16}


class Precision:
    """Autocast for the forward, and the gradient scaler of fp16.

    Args:
        setting: ``training.precision``.
        device: the worker's device (autocast and the scaler are per device type).
    """

    def __init__(
        self, setting: PrecisionSetting = PrecisionSetting.FP32, device: torch.device | None = None
    ) -> None:
        self.setting = setting
        self._device_type = (device or torch.device("cpu")).type
        self._dtype = _AUTOCAST.get(setting)
        self.scaler: torch.amp.GradScaler | None = None
        if setting is PrecisionSetting.FP16:
            self.scaler = torch.amp.GradScaler(self._device_type)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward and the loss in the setting's dtype (nothing changes for fp32); entered
        once per batch, so a plain context object rather than a generator."""
        if self._dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=self._dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (scaled first under fp16)."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def overflowed(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, module: nn.Module) -> bool:
        """Unscale the gradients (fp16); True when the scaled gradients overflowed although the
        loss is finite: the scaler's to handle, so the step is skipped and its scale lowered
        here, and nobody else (the NaN guard) needs to be asked. False for fp32 and bf16."""
        if self.scaler is None:
            return False
        self.scaler.unscale_(optimizer)
        if bool(torch.isfinite(loss).all()) and not grads_finite(module):
            self.scaler.step(optimizer)  # skipped: it found the infinities
            self.scaler.update()
            return True
        return False

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step (through the scaler under fp16, which then updates its scale)."""
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
