"""Sync strategies: how workers keep their models consistent (one module each, loaded
when chosen; see :data:`sparkdl.training.strategy.REGISTRY`)."""

from sparkdl.training.strategy import (
    REGISTRY,
    StepInput,
    StrategyContext,
    SyncStats,
    SyncStrategy,
    check_settings,
    create_strategy,
    strategy_class,
)

__all__ = [
    "REGISTRY",
    "StepInput",
    "StrategyContext",
    "SyncStats",
    "SyncStrategy",
    "check_settings",
    "create_strategy",
    "strategy_class",
]
