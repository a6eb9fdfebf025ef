"""Sync strategies: how workers keep their models consistent (one module each, loaded
when chosen; see :mod:`sparkdl.strategies.registry`)."""

from sparkdl.strategies.registry import (
    REGISTRY,
    check_settings,
    create_strategy,
    own_loop_strategies,
    strategy_class,
)
from sparkdl.training.strategy import StepInput, StrategyContext, SyncStats, SyncStrategy

__all__ = [
    "REGISTRY",
    "StepInput",
    "StrategyContext",
    "SyncStats",
    "SyncStrategy",
    "check_settings",
    "create_strategy",
    "own_loop_strategies",
    "strategy_class",
]
