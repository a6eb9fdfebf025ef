"""sparkdl: train PyTorch models on Spark DataFrames, as a pyspark.ml Estimator."""

from sparkdl.config import SparkDLConfig, load_config
from sparkdl.errors import (
    BadDataError,
    ClusterConfigError,
    CollectiveError,
    ConfigError,
    ExecutorEnvironmentError,
    ModelMismatchError,
    RendezvousError,
    SchemaError,
    SparkDLError,
    StageStalledError,
    TrainingFailedError,
)
from sparkdl.estimator import TorchEstimator, TorchModel
from sparkdl.runtime.session import session

__version__ = "0.1.0"

__all__ = [
    "BadDataError",
    "ClusterConfigError",
    "CollectiveError",
    "ConfigError",
    "ExecutorEnvironmentError",
    "ModelMismatchError",
    "RendezvousError",
    "SchemaError",
    "SparkDLConfig",
    "SparkDLError",
    "StageStalledError",
    "TorchEstimator",
    "TorchModel",
    "TrainingFailedError",
    "load_config",
    "session",
]
