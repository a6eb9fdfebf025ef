"""Sync strategies: how workers keep their models consistent."""

from sparkdl.strategies import allreduce as _allreduce  # noqa: F401  (registers itself)
from sparkdl.strategies import parameter_server as _parameter_server  # noqa: F401
from sparkdl.strategies import weight_averaging as _weight_averaging  # noqa: F401
from sparkdl.strategies.base import StepInput, StrategyContext, SyncStats, SyncStrategy, create_strategy

__all__ = ["StepInput", "StrategyContext", "SyncStats", "SyncStrategy", "create_strategy"]
