"""Sync strategies: how workers keep their models consistent (one module each, loaded
when chosen; see :data:`sparkdl.strategies.base.REGISTRY`)."""

from sparkdl.strategies.base import (
    REGISTRY,
    StepInput,
    StrategyContext,
    SyncStats,
    SyncStrategy,
    create_strategy,
    strategy_class,
)

__all__ = [
    "REGISTRY",
    "StepInput",
    "StrategyContext",
    "SyncStats",
    "SyncStrategy",
    "create_strategy",
    "strategy_class",
]
