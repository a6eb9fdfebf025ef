"""Refusals that more than one strategy shares, each with the fix.

A strategy's own rules live in its class (:meth:`SyncStrategy.check_settings`); the ones
here are called by several of them, so that the message is written once.
"""

from __future__ import annotations

from sparkdl.config import Compression, Hierarchy, Precision, SparkDLConfig
from sparkdl.errors import ConfigError


def refuse_powersgd(config: SparkDLConfig) -> None:
    """PowerSGD is DDP's communication hook: only strategy "allreduce" has one."""
    if config.runtime.compression is Compression.POWERSGD:
        raise ConfigError(
            f"compression = 'powersgd' is PyTorch's DDP hook of strategy 'allreduce'; with strategy = "
            f"{config.training.strategy.value!r} use '1bit', 'topk', 'fp16' or 'bf16'"
        )


def refuse_backups_without_a_worker(
    config: SparkDLConfig, setting: str, backups: int, why: str, hierarchy_why: str
) -> None:
    """Backup workers (``setting`` = ``backups``) must leave at least one worker to make
    each step (``why`` says how it is made), and two levels have none (``hierarchy_why``)."""
    workers = config.training.num_workers
    if backups >= workers:
        raise ConfigError(
            f"{setting} = {backups} must be < num_workers = {workers}: {why}; set {setting} to at "
            f"most {workers - 1} (0 waits for every worker), or raise num_workers"
        )
    level = config.runtime.hierarchy
    if level is not Hierarchy.NONE and backups:
        raise ConfigError(f"hierarchy = {level.value!r} with {setting} = {backups}: {hierarchy_why}")


def refuse_compressed_hierarchy(config: SparkDLConfig) -> None:
    """Two-level sums exchange float32 between the hosts' leaders: no codec there yet."""
    compression, level = config.runtime.compression, config.runtime.hierarchy
    if level is not Hierarchy.NONE and compression is not Compression.NONE:
        raise ConfigError(
            f"hierarchy = {level.value!r} and compression = {compression.value!r} do not combine with "
            f"strategy {config.training.strategy.value!r} (the leaders exchange float32); choose one "
            "of them"
        )


def refuse_fp16(config: SparkDLConfig, why: str, instead: str = "") -> None:
    """fp16's gradient scaler sees one worker's whole gradient; a strategy that spreads it
    (``why``) takes bf16 (or ``instead``)."""
    if config.training.precision is Precision.FP16:
        also = f", {instead}" if instead else ""
        raise ConfigError(
            f"precision = 'fp16' is not available with strategy = {config.training.strategy.value!r} "
            f"({why}); use precision = 'bf16'{also}"
        )


def refuse_compression(config: SparkDLConfig, why: str = "") -> None:
    """A strategy whose collectives have no codec (``why``) sends float32 as it is."""
    _refuse_unless_off(config, "compression", config.runtime.compression, Compression.NONE, why)


def refuse_hierarchy(config: SparkDLConfig, why: str = "") -> None:
    """A strategy whose collectives are not the exchange's (``why``) has no two levels."""
    _refuse_unless_off(config, "hierarchy", config.runtime.hierarchy, Hierarchy.NONE, why)


def _refuse_unless_off(
    config: SparkDLConfig,
    setting: str,
    value: Compression | Hierarchy,
    off: Compression | Hierarchy,
    why: str,
) -> None:
    if value is not off:
        because = f" ({why})" if why else ""
        raise ConfigError(
            f"{setting} = {value.value!r} is not available with strategy = "
            f"{config.training.strategy.value!r}{because}; set {setting} = {off.value!r}"
        )
