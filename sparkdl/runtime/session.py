"""Building a SparkSession that suits barrier-mode training."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from sparkdl.config import SparkDLConfig


def recommended_conf(config: SparkDLConfig) -> dict[str, str]:
    """Spark settings every sparkdl session should have.

    - ``spark.barrier.sync.timeout``: a stuck barrier fails after the collective
      timeout instead of Spark's default of one year;
    - Arrow batches of a bounded size feed the executors;
    """
    timeout = int(config.runtime.collective_timeout_s)
    return {
        "spark.barrier.sync.timeout": f"{timeout}s",
        "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "5s",
        "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "3",
        "spark.sql.execution.arrow.maxRecordsPerBatch": "10000",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "8",
    }


def build_session(
    master: str | None,
    app_name: str,
    config: SparkDLConfig,
    extra: Mapping[str, str] | None = None,
) -> Any:
    """Get or create a SparkSession with :func:`recommended_conf` plus ``extra``.

    ``master`` None keeps what spark-submit configured. Sets ``PYSPARK_PYTHON`` to
    this interpreter when unset, so local executors find torch; on a cluster whose
    workers keep Python elsewhere, export ``PYSPARK_PYTHON`` before starting.
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    for key, value in {**recommended_conf(config), **(extra or {})}.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def session(
    master: str | None = "local[2]",
    app_name: str = "sparkdl",
    config: SparkDLConfig | None = None,
    **spark_conf: str,
) -> Any:
    """A SparkSession that suits barrier training: timeouts set from ``config``, local
    executors on this interpreter (``PYSPARK_PYTHON``), plus more Spark settings by their
    full names (``**{"spark.driver.memory": "4g"}``).

    Example::

        import sparkdl
        spark = sparkdl.session("local[2]", "my-app")

    Args:
        master: the Spark master; None keeps what spark-submit or the notebook configured.
        app_name: the application's name.
        config: the settings whose timeouts the session should match (defaults if None).
        spark_conf: more Spark settings, by their full names.
    """
    return build_session(master, app_name, config or SparkDLConfig(), spark_conf)
