"""sparkdl: train PyTorch models on Spark DataFrames, as a pyspark.ml Estimator."""

from sparkdl.config import SparkDLConfig, load_config
from sparkdl.errors import (
    BadDataError,
    ClusterConfigError,
    CollectiveError,
    ConfigError,
    RendezvousError,
    SchemaError,
    SparkDLError,
    TrainingFailedError,
)
from sparkdl.estimator import TorchEstimator, TorchModel

__version__ = "0.1.0"

__all__ = [
    "BadDataError",
    "ClusterConfigError",
    "CollectiveError",
    "ConfigError",
    "RendezvousError",
    "SchemaError",
    "SparkDLConfig",
    "SparkDLError",
    "TorchEstimator",
    "TorchModel",
    "TrainingFailedError",
    "load_config",
]
