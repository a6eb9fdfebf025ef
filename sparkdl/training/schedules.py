"""Learning-rate schedules as pure functions of the global step, shared by every strategy.

A schedule is a factor of the configured ``lr``: the worker's optimizer (all-reduce,
weight averaging) and the parameter server's optimizers (which step on the server)
apply the same factor at the same step, so a run's learning rate does not depend on
the strategy. Schedules that decay over the run need its length in steps; the driver
estimates it before the stage starts (:func:`steps_per_epoch_estimate`), since epoch 1
streams and its exact length is known only once it has been read.

The large-batch rule (Goyal et al., "Accurate, Large Minibatch SGD"): with
``scale_lr`` the peak is ``lr x num_workers``, reached by a linear warm-up from ``lr``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparkdl.config import LrSchedule, SparkDLConfig


@dataclass(frozen=True)
class LrPlan:
    """The factor of the configured lr at every global step (0-based: the step about to be taken).

    Attributes:
        schedule: the shape after warm-up.
        warmup_steps: linear warm-up length (0: none).
        total_steps: the run's length in steps (estimated; decays end there).
        milestone_steps: steps at which a step schedule multiplies by ``gamma``.
        gamma: a step schedule's factor per milestone.
        peak: the factor at the end of warm-up (num_workers with scale_lr, else 1).
    """

    schedule: LrSchedule = LrSchedule.CONSTANT
    warmup_steps: int = 0
    total_steps: int = 0
    milestone_steps: tuple[int, ...] = ()
    gamma: float = 0.1
    peak: float = 1.0

    @property
    def is_constant(self) -> bool:
        return self.schedule is LrSchedule.CONSTANT and self.warmup_steps == 0 and self.peak == 1.0

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            start = 1.0 if self.peak > 1.0 else 0.0  # scale_lr warms up from lr itself
            return start + (self.peak - start) * (step + 1) / self.warmup_steps
        if self.schedule is LrSchedule.STEP:
            return self.peak * self.gamma ** sum(step >= m for m in self.milestone_steps)
        if self.schedule is LrSchedule.CONSTANT:
            return self.peak
        span = max(self.total_steps - self.warmup_steps, 1)
        done = min(max(step - self.warmup_steps, 0) / span, 1.0)
        if self.schedule is LrSchedule.WARMUP_COSINE:
            return self.peak * 0.5 * (1.0 + math.cos(math.pi * done))
        return self.peak * (1.0 - done)


#: The plan of a run without any schedule: lr as configured, every step.
CONSTANT_LR = LrPlan()


def lr_plan(config: SparkDLConfig, steps_per_epoch: int = 0) -> LrPlan:
    """The plan of a run's settings; ``steps_per_epoch`` is the driver's estimate."""
    opt, training = config.optimizer, config.training
    return LrPlan(
        schedule=opt.lr_schedule,
        warmup_steps=opt.warmup_steps,
        total_steps=steps_per_epoch * training.epochs,
        milestone_steps=tuple(max(m - 1, 0) * steps_per_epoch for m in opt.lr_milestones),
        gamma=opt.lr_gamma,
        peak=float(training.num_workers) if opt.scale_lr else 1.0,
    )


def needs_run_length(config: SparkDLConfig) -> bool:
    """Whether the schedule needs the number of steps per epoch (decay or milestones)."""
    return config.optimizer.lr_schedule is not LrSchedule.CONSTANT


def steps_per_epoch_estimate(rows: int, config: SparkDLConfig) -> int:
    """Steps of one epoch when ``rows`` rows are spread evenly over the workers."""
    training = config.training
    per_step = training.num_workers * training.batch_size * training.accumulate_steps
    return max(math.ceil(rows / per_step), 1)


class ScheduledLr:
    """Sets an optimizer's learning rates for each step: the configured lr of every param
    group (as the optimizer was built) times the plan's factor."""

    def __init__(self, optimizer: torch.optim.Optimizer, plan: LrPlan) -> None:
        self._optimizer = optimizer
        self._plan = plan
        self._base = [group["lr"] for group in optimizer.param_groups]

    def apply(self, step: int) -> None:
        factor = self._plan.factor(step)
        for group, base in zip(self._optimizer.param_groups, self._base, strict=True):
            group["lr"] = base * factor
