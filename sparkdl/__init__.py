"""sparkdl: train PyTorch models on Spark DataFrames, as a pyspark.ml Estimator.

The public names load on first use, so that code shipped to executors (and the
torch-only training loop) does not import pyspark.ml, the estimator or the driver's
servers just because it lives in this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "BadDataError": "sparkdl.errors",
    "ClusterConfigError": "sparkdl.errors",
    "CollectiveError": "sparkdl.errors",
    "ConfigError": "sparkdl.errors",
    "ExecutorEnvironmentError": "sparkdl.errors",
    "ModelMismatchError": "sparkdl.errors",
    "RendezvousError": "sparkdl.errors",
    "SchemaError": "sparkdl.errors",
    "SparkDLError": "sparkdl.errors",
    "StageStalledError": "sparkdl.errors",
    "WorkersLostError": "sparkdl.errors",
    "TrainingFailedError": "sparkdl.errors",
    "SparkDLConfig": "sparkdl.config",
    "load_config": "sparkdl.config",
    "TorchEstimator": "sparkdl.ml.estimator",
    "TorchModel": "sparkdl.ml.estimator",
    "advise": "sparkdl.advisor.advise",
    "loading": "sparkdl.ml.persistence",
    "session": "sparkdl.spark.session",
    "TorchDistributor": "sparkdl.launch.distributor",
    "run": "sparkdl.launch.run",
    "RunResult": "sparkdl.launch.run",
    "TrainFunctionError": "sparkdl.errors",
    "RunTimeout": "sparkdl.errors",
    "StreamingFit": "sparkdl.ml.streaming",
    "fit_stream": "sparkdl.ml.streaming",
    "latest_model": "sparkdl.ml.streaming",
    "save_pipeline": "sparkdl.ml.pipelines",
    "load_pipeline": "sparkdl.ml.pipelines",
}

__all__ = [
    "BadDataError",
    "ClusterConfigError",
    "CollectiveError",
    "ConfigError",
    "ExecutorEnvironmentError",
    "ModelMismatchError",
    "RendezvousError",
    "RunResult",
    "RunTimeout",
    "SchemaError",
    "SparkDLConfig",
    "SparkDLError",
    "StageStalledError",
    "StreamingFit",
    "TorchDistributor",
    "TorchEstimator",
    "TorchModel",
    "TrainFunctionError",
    "TrainingFailedError",
    "WorkersLostError",
    "advise",
    "fit_stream",
    "latest_model",
    "load_config",
    "load_pipeline",
    "loading",
    "run",
    "save_pipeline",
    "session",
]

if TYPE_CHECKING:
    from sparkdl.advisor.advise import advise
    from sparkdl.config import SparkDLConfig, load_config
    from sparkdl.errors import (
        BadDataError,
        ClusterConfigError,
        CollectiveError,
        ConfigError,
        ExecutorEnvironmentError,
        ModelMismatchError,
        RendezvousError,
        RunTimeout,
        SchemaError,
        SparkDLError,
        StageStalledError,
        TrainFunctionError,
        TrainingFailedError,
        WorkersLostError,
    )
    from sparkdl.launch.distributor import TorchDistributor
    from sparkdl.launch.run import RunResult, run
    from sparkdl.ml.estimator import TorchEstimator, TorchModel
    from sparkdl.ml.persistence import loading
    from sparkdl.ml.pipelines import load_pipeline, save_pipeline
    from sparkdl.ml.streaming import StreamingFit, fit_stream, latest_model
    from sparkdl.spark.session import session


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'sparkdl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
