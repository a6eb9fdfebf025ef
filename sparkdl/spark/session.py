"""Building a SparkSession that suits barrier-mode training."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from sparkdl.config import SparkDLConfig

log = logging.getLogger(__name__)


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


#: The Spark setting naming the Python worker daemon; sparkdl's imports torch before forking.
DAEMON_MODULE = "spark.python.daemon.module"


def build_session(
    master: str | None,
    app_name: str,
    config: SparkDLConfig,
    extra: Mapping[str, str] | None = None,
) -> Any:
    """Get or create a SparkSession with :func:`recommended_conf` plus ``extra``.

    ``master`` None keeps what spark-submit configured. Sets ``PYSPARK_PYTHON`` to
    this interpreter when unset, so local executors find torch; on a cluster whose
    workers keep Python elsewhere, export ``PYSPARK_PYTHON`` before starting. A local
    master's Python workers fork from :mod:`sparkdl.spark.daemon`, torch already
    imported (a faster first fit).
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    conf = recommended_conf(config)
    if master and master.startswith("local"):  # executors run this interpreter, which has sparkdl
        conf[DAEMON_MODULE] = "sparkdl.spark.daemon"
    for key, value in {**conf, **(extra or {})}.items():
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

    The session starts warming up at once, in the background (:func:`warm_up`), so that
    the first fit starts about as fast as the later ones.

    Example::

        import sparkdl
        spark = sparkdl.session("local[2]", "my-app")

    Args:
        master: the Spark master; None keeps what spark-submit or the notebook configured.
        app_name: the application's name.
        config: the settings whose timeouts the session should match (defaults if None).
        spark_conf: more Spark settings, by their full names.
    """
    config = config or SparkDLConfig()
    spark = build_session(master, app_name, config, spark_conf)
    warm_up(spark, config)
    return spark


def _pass_through(batches: Iterator[Any]) -> Iterator[Any]:
    """A ``mapInArrow`` function that changes nothing: the warm-up's first Arrow stage."""
    yield from batches


def warm_up(spark: Any, config: SparkDLConfig) -> threading.Thread:
    """Do, in the background, what a fresh session's first fit would otherwise wait for.

    On a fresh session the first fit paid about 5 s before training (measured in
    ``benchmarks/bench_first_fit.py``): the executors' Python check, which starts the
    Python worker daemon (torch imported) and the workers; the JVM's first Arrow stage
    (about 2.5 s); and on the driver the first optimizer (torch imports its compiler
    stack then). Started when the
    session is built, this overlaps with the caller's own work (reading data); a fit that
    starts sooner waits for the check already under way instead of running its own.
    A failure here is left for the fit's own check to report.
    """
    from sparkdl.spark.environment import check_executor_environment

    def run() -> None:
        try:
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
            workers = max(int(spark.sparkContext.defaultParallelism), 1)
            wait_s = max(config.runtime.executor_wait_timeout_s, 60.0)
            if check_executor_environment(spark, wait_s, workers) is not None:  # sparkdl runs there
                spark.range(workers, numPartitions=workers).mapInArrow(_pass_through, "id long").collect()
        except Exception as exc:  # the fit checks again and reports it
            log.debug("warm-up of the new session failed: %s", exc)

    thread = threading.Thread(target=run, name="sparkdl-warm-up", daemon=True)
    thread.start()
    return thread
