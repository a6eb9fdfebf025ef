"""Models for the multihost drills, importable on every host's executors."""

from __future__ import annotations

import time

import torch

from tests.reference import TinyNet


class SlowTinyNet(TinyNet):
    """TinyNet (the same parameters, the same initialization) whose forward takes at least
    ``step_s``: a fit lasts long enough for a drill to cut a host in the middle of it."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.step_s)
        return super().forward(x)


class SlowLinear(torch.nn.Linear):
    """A linear classifier whose training forward takes at least ``step_s``."""

    def __init__(self, inputs: int, outputs: int, step_s: float) -> None:
        super().__init__(inputs, outputs)
        self.step_s = step_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(self.step_s)
        return super().forward(x)


class SlowPartitionLinear(SlowLinear):
    """SlowLinear whose forward takes ``factor`` times as long in the task of partition
    ``slow_partition``: one worker slower than the others."""

    def __init__(self, inputs: int, outputs: int, step_s: float, slow_partition: int, factor: float) -> None:
        super().__init__(inputs, outputs, step_s)
        self.slow_partition, self.factor = slow_partition, factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            from pyspark import TaskContext

            ctx = TaskContext.get()
            if ctx is not None and ctx.partitionId() == self.slow_partition:
                time.sleep(self.step_s * (self.factor - 1))
        return super().forward(x)
