"""The strategies by name, and the rules of a run's settings that involve its strategy.

Adding a strategy is one module in this package (its class: the step, its rules, its
face to a user's own loop and the class variables the advisor and the driver read), one
entry in :data:`REGISTRY`, a name in :class:`~sparkdl.config.Strategy` and, if it has
settings, their section in :mod:`sparkdl.config.strategy_sections`.

Each entry imports its module only when that strategy is chosen (the import statement
sits in a function, where the import contract still sees it), so that an all-reduce
worker never loads the parameter server's sockets.
"""

from __future__ import annotations

from collections.abc import Callable

from sparkdl.config import SparkDLConfig, Strategy, SufficientFactors
from sparkdl.errors import ConfigError
from sparkdl.training.factory import check_compile_backend
from sparkdl.training.full_batch_settings import check_full_batch_settings
from sparkdl.training.strategy import StrategyContext, SyncStrategy


def _allreduce() -> type[SyncStrategy]:
    from sparkdl.strategies.allreduce import AllReduceStrategy

    return AllReduceStrategy


def _weight_averaging() -> type[SyncStrategy]:
    from sparkdl.strategies.weight_averaging import WeightAveragingStrategy

    return WeightAveragingStrategy


def _parameter_server() -> type[SyncStrategy]:
    from sparkdl.strategies.parameter_server import ParameterServerStrategy

    return ParameterServerStrategy


def _fsdp() -> type[SyncStrategy]:
    from sparkdl.strategies.fsdp import FsdpStrategy

    return FsdpStrategy


def _pipeline() -> type[SyncStrategy]:
    from sparkdl.strategies.pipeline import PipelineStrategy

    return PipelineStrategy


def _tensor() -> type[SyncStrategy]:
    from sparkdl.strategies.tensor import TensorParallelStrategy

    return TensorParallelStrategy


#: Each strategy's class, loaded when it is chosen.
REGISTRY: dict[Strategy, Callable[[], type[SyncStrategy]]] = {
    Strategy.ALLREDUCE: _allreduce,
    Strategy.WEIGHT_AVERAGING: _weight_averaging,
    Strategy.PARAMETER_SERVER: _parameter_server,
    Strategy.FSDP: _fsdp,
    Strategy.PIPELINE: _pipeline,
    Strategy.TENSOR: _tensor,
}


def strategy_class(name: Strategy) -> type[SyncStrategy]:
    """The class registered for ``name``.

    Raises:
        ConfigError: no strategy of that name is registered (the message lists those that are).
    """
    try:
        load = REGISTRY[name]
    except KeyError:
        valid = ", ".join(s.value for s in REGISTRY)
        raise ConfigError(f"strategy {name.value!r} is not available; choose one of {valid}") from None
    return load()


def create_strategy(ctx: StrategyContext) -> SyncStrategy:
    """Build the strategy named by ``ctx.config.training.strategy``."""
    return strategy_class(ctx.config.training.strategy)(ctx)


def own_loop_strategies() -> list[Strategy]:
    """The strategies that serve a user's own loop (``serves_own_loop``)."""
    return [name for name in REGISTRY if strategy_class(name).serves_own_loop]


def check_settings(config: SparkDLConfig) -> SparkDLConfig:
    """``config``, once its strategy accepted it: the rules that involve one strategy
    (what it cannot combine with) live in that strategy's class, not in the config layer
    below it. TorchEstimator, the jobs' loaders, fit and the advisor call this.

    Raises:
        ConfigError: the strategy cannot run with these settings; the message says the fix.
    """
    cls = strategy_class(config.training.strategy)
    factors = config.runtime.sufficient_factors
    if factors is not SufficientFactors.OFF and not cls.takes_sufficient_factors:
        takers = ", ".join(repr(s.value) for s in REGISTRY if strategy_class(s).takes_sufficient_factors)
        raise ConfigError(
            f"sufficient_factors = {factors.value!r} with strategy {cls.name.value!r}: only {takers} "
            "send gradients as factors; set sufficient_factors = 'off'"
        )
    if not config.parameter_server.ps_barrier and cls.name.value != "parameter_server":
        raise ConfigError(
            f"parameter_server.ps_barrier = false with strategy {cls.name.value!r}: only the asynchronous "
            "(or stale-synchronous) parameter server trains without its workers meeting; the other "
            "strategies exchange between the workers every step or period, so they run as one barrier "
            "stage. Set ps_barrier = true, or strategy = 'parameter_server' with ps_mode = 'async' or 'ssp'"
        )
    level = config.runtime.hierarchy
    if factors is not SufficientFactors.OFF and level.value != "none":
        raise ConfigError(
            f"sufficient_factors = {factors.value!r} with hierarchy = {level.value!r}: a host's sum of "
            "factors is a matrix again, so the two do not combine; set one of them to off / none"
        )
    if config.training.compile and not cls.compiles:
        takers = ", ".join(repr(s.value) for s in REGISTRY if strategy_class(s).compiles)
        raise ConfigError(
            f"compile = true with strategy {cls.name.value!r}: only {takers} compile the model; "
            "set compile = false (or call torch.compile in model_fn yourself)"
        )
    if config.training.compile:
        check_compile_backend(config.training.compile_backend)
    _check_min_workers(config, cls)
    check_full_batch_settings(config)
    cls.check_settings(config)
    return config


def _check_min_workers(config: SparkDLConfig, cls: type[SyncStrategy]) -> None:
    floor, n = config.reliability.min_workers, config.training.num_workers
    if floor > n:
        raise ConfigError(
            f"min_workers = {floor} is more than num_workers = {n}; set min_workers to at most "
            f"{n} (0: never go on with fewer workers)"
        )
    if 0 < floor < n and not cls.resizes:
        raise ConfigError(
            f"min_workers = {floor} < num_workers = {n} with strategy {cls.name.value!r}, whose layout "
            "num_workers fixes (the parameter server's clocks count its workers; pipeline stages and "
            "tensor groups divide them); set min_workers = 0, or use allreduce, fsdp or weight_averaging"
        )
