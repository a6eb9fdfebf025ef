"""The driver's Spark conf as storage credentials for the tasks.

Executors do not see ``spark.hadoop.fs.s3a.*`` (set at start or with ``spark.conf.set``) as
fsspec options: the driver reads them and adds them under ``reliability.storage_options``
(which win) in the settings the tasks carry, where no log, MLflow param or saved model shows
them (:data:`~sparkdl.config.SECRET_SETTINGS`).
"""

from __future__ import annotations

from typing import Any

from sparkdl.config import SparkDLConfig
from sparkdl.config.loading import url_scheme
from sparkdl.storage.filesystems import conf_options


def with_spark_storage_options(spark: Any, config: SparkDLConfig) -> SparkDLConfig:
    """``config`` with the s3fs options the driver's ``spark.hadoop.fs.s3a.*`` conf gives
    under its own ``storage_options`` (an ``s3://``/``s3a://`` checkpoint_dir only)."""
    if url_scheme(config.reliability.checkpoint_dir) not in ("s3", "s3a"):
        return config
    given = conf_options(spark)
    if not given:
        return config
    return config.replace(storage_options={**given, **config.reliability.storage_options})
