"""What ``optimizer = "lbfgs"`` is built from, and the settings it cannot run with: the
algorithm's settings from ``[lbfgs]`` and ``[optimizer]``, and the refusals, each with its
fix, that :func:`sparkdl.strategies.registry.check_settings` applies before any worker starts.
"""

from __future__ import annotations

from sparkdl.config import (
    Compression,
    LbfgsObjective,
    LrSchedule,
    OptimizerName,
    PsMode,
    SparkDLConfig,
    Strategy,
    SufficientFactors,
)
from sparkdl.errors import ConfigError
from sparkdl.training.lbfgs import LbfgsSettings


def lbfgs_settings(config: SparkDLConfig) -> LbfgsSettings:
    """The algorithm's settings from ``[lbfgs]`` and ``[optimizer]``."""
    lbfgs = config.lbfgs
    return LbfgsSettings(
        lr=config.optimizer.lr,
        max_iterations=lbfgs.max_iterations,
        max_evaluations=lbfgs.max_evaluations,
        tolerance_grad=lbfgs.tolerance_grad,
        tolerance_change=lbfgs.tolerance_change,
        history_size=lbfgs.history_size,
        line_search=lbfgs.line_search,
    )


def check_full_batch_settings(config: SparkDLConfig) -> None:
    """Refuse, with the fix, what ``optimizer = "lbfgs"`` cannot run with: a pass is the
    whole partition and a step is the line search's, so the settings of steps have no
    meaning here, and a lossy or scaled sum would mislead the line search.

    Raises:
        ConfigError: naming the setting and what to set instead.
    """
    if config.optimizer.optimizer is not OptimizerName.LBFGS:
        return
    for clash, message in (*_layout_refusals(config).values(), *_step_refusals(config).values()):
        if clash:
            raise ConfigError(f"optimizer = 'lbfgs' with {message}")


def _layout_refusals(config: SparkDLConfig) -> dict[str, tuple[bool, str]]:
    """Where L-BFGS's vectors may live, and what the server's layout cannot do: each
    setting's clash and its message."""
    training, runtime = config.training, config.runtime
    ps, served = config.parameter_server, training.strategy is Strategy.PARAMETER_SERVER
    return {
        "strategy": (
            training.strategy not in (Strategy.ALLREDUCE, Strategy.PARAMETER_SERVER),
            f"strategy = {training.strategy.value!r}: L-BFGS sums every worker's gradient over its whole "
            "partition each pass; set strategy = 'allreduce' (the vectors on every worker) or "
            "'parameter_server' (on the server's shards)",
        ),
        "ps_mode": (
            served and ps.ps_mode is not PsMode.SYNC,
            f"ps_mode = {ps.ps_mode.value!r}: every pass must see one point; set ps_mode = 'sync'",
        ),
        "backup_workers": (
            served and bool(ps.backup_workers),
            f"backup_workers = {ps.backup_workers}: a pass needs every worker's rows; set it to 0",
        ),
        "ps_pull_precision": (
            served and ps.ps_pull_precision.value != "fp32",
            "ps_pull_precision = 'bf16': the line search needs the point it chose; set it to 'fp32'",
        ),
        "hierarchy": (
            served and runtime.hierarchy.value != "none",
            f"hierarchy = {runtime.hierarchy.value!r} and strategy 'parameter_server': every worker "
            "pushes its own pass; set hierarchy = 'none'",
        ),
        "validation": (
            served and bool(training.validation_fraction or training.validation_col),
            "validation and strategy 'parameter_server': the driver's coordinator measures no "
            "held-out rows yet; use strategy 'allreduce' (validated after every iteration), or "
            "unset validation_fraction and validation_col",
        ),
        "checkpoint_dir": (
            served and bool(config.reliability.checkpoint_dir),
            "checkpoint_dir and strategy 'parameter_server': the driver's coordinator carries the run "
            "across re-run stages, and the shards' vectors are not checkpointed yet; unset "
            "checkpoint_dir, or use strategy 'allreduce' to checkpoint every checkpoint_every iterations",
        ),
        "objective": (
            served and config.lbfgs.objective is LbfgsObjective.SPARK,
            "objective = 'spark' and strategy 'parameter_server': the shards' coordinator divides by "
            "the rows, not yet by the weights' sum; use strategy 'allreduce'",
        ),
    }


def _step_refusals(config: SparkDLConfig) -> dict[str, tuple[bool, str]]:
    """The settings of steps, which a pass over the whole partition gives no meaning, and
    sums the line search cannot trust: each setting's clash and its message."""
    training, optimizer, runtime = config.training, config.optimizer, config.runtime
    return {
        "precision": (
            training.precision.value == "fp16",
            "precision = 'fp16' scales the loss step by step; use 'bf16' or 'fp32'",
        ),
        "compression": (
            runtime.compression is not Compression.NONE,
            f"compression = {runtime.compression.value!r}: a lossy gradient misleads the line search; "
            "set compression = 'none'",
        ),
        "sufficient_factors": (
            runtime.sufficient_factors is not SufficientFactors.OFF,
            "sufficient_factors: a pass's gradient sums every row, so factors never pay; set it to 'off'",
        ),
        "accumulate_steps": (
            training.accumulate_steps != 1,
            f"accumulate_steps = {training.accumulate_steps}: every pass sums the whole partition "
            "(batch_size only sets the rows of one forward); set accumulate_steps = 1",
        ),
        "lr_schedule": (
            optimizer.lr_schedule is not LrSchedule.CONSTANT
            or bool(optimizer.warmup_steps)
            or bool(optimizer.scale_lr),
            "lr_schedule, warmup_steps and scale_lr: the line search chooses each step's length; "
            "leave them at their defaults",
        ),
        "grad_clip_norm": (
            bool(optimizer.grad_clip_norm),
            f"grad_clip_norm = {optimizer.grad_clip_norm}: the line search bounds the step; set it to 0",
        ),
        "early_stopping_patience": (
            bool(training.early_stopping_patience),
            "early_stopping_patience: L-BFGS stops by tolerance_grad, tolerance_change and "
            "max_iterations; set it to 0",
        ),
    }


def check_full_batch_inputs(
    config: SparkDLConfig, optimizer_fn: object, scheduler_fn: object, validation: bool
) -> None:
    """Refuse what a TorchEstimator gives besides its settings that ``optimizer = "lbfgs"``
    cannot use: its own optimizer or scheduler (the line search decides every step), and,
    on the parameter server, held-out rows (its coordinator measures none yet).

    Raises:
        ConfigError: naming what was given and what to do instead.
    """
    if config.optimizer.optimizer is not OptimizerName.LBFGS:
        return
    if optimizer_fn is not None or scheduler_fn is not None:
        given = "optimizer_fn" if optimizer_fn is not None else "scheduler_fn"
        raise ConfigError(
            f"optimizer = 'lbfgs' trains full-batch with sparkdl's L-BFGS, which {given} cannot "
            f"replace; drop {given}, or choose a step-wise optimizer (optimizer = 'sgd', ...)"
        )
    if validation and config.training.strategy is Strategy.PARAMETER_SERVER:
        raise ConfigError(
            "optimizer = 'lbfgs' with strategy 'parameter_server' measures no held-out rows yet; "
            "use strategy 'allreduce' (validated after every iteration), or drop the validation"
        )
