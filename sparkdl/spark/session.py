"""Building a SparkSession that suits barrier-mode training."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from sparkdl.config import SparkDLConfig
from sparkdl.worker.address_space import UNDER_A_LIMIT

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
#: Each Python worker's memory, which PySpark sets as its address-space limit.
PYSPARK_MEMORY = "spark.executor.pyspark.memory"


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

    if not os.environ.get("PYSPARK_PYTHON"):  # unset, or set to nothing
        os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    conf = {**recommended_conf(config), **(extra or {})}
    if master and master.startswith("local"):  # executors run this interpreter, which has sparkdl
        conf.setdefault(DAEMON_MODULE, "sparkdl.spark.daemon")
    if PYSPARK_MEMORY in conf:  # a limit on the workers' address space: reserve none of it ahead
        for name, value in UNDER_A_LIMIT.items():
            conf.setdefault(f"spark.executorEnv.{name}", value)
    for key, value in conf.items():
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

    Where the machine has cores to spare, the session starts warming up at once, in the
    background (:func:`warm_up`), so that the first fit starts about as fast as the later ones.

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


#: The job group of the warm-up's Arrow stage (the check has its own), cancelled at exit.
WARM_UP_GROUP = "sparkdl-warm-up"
_STOP_WAIT_S = 30.0
_CANCEL_WAIT_S = 10.0  # then for the cancelled tasks to report their end


def warm_up(spark: Any, config: SparkDLConfig) -> threading.Thread | None:
    """Do, in the background, what a fresh session's first fit would otherwise wait for,
    where the machine has cores to spare for it (:func:`has_spare_cores`); else nothing.

    A fresh session's first fit pays for the executors' Python check, which starts the
    Python workers of SQL stages and imports torch and sparkdl there; the JVM's first Arrow
    stage; and on the driver the first optimizer (torch imports its compiler stack then).
    Started when the session is built, this overlaps with the caller's own work (reading
    data); a fit that starts sooner waits for the check already under way instead of
    running its own. On a machine without spare cores the same work competes with the
    caller's instead: measured on 2 cores (``benchmarks/bench_first_fit.py``), the warm-up
    made the user's first ``count`` 4.5x slower and the first model no sooner, so it is
    skipped there (the fit's own check then warms the workers it trains in). A failure
    here is left for the fit's own check to report. An interpreter that exits while the
    warm-up runs waits for it (at most 30 s), so that no task is killed under Spark; past
    that it cancels the warm-up and waits (at most 10 s) for the killed tasks to report.

    Returns:
        the warm-up's thread, or None when it was skipped.
    """
    from sparkdl.spark.environment import check_executor_environment, environment_job_group

    sc = spark.sparkContext
    if not has_spare_cores(sc.master, int(sc.defaultParallelism)):
        log.debug("no warm-up: %s leaves no core of this machine to spare", sc.master)
        return None

    def run() -> None:
        try:
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
            workers = max(int(sc.defaultParallelism), 1)
            wait_s = max(config.runtime.executor_wait_timeout_s, 60.0)
            if check_executor_environment(spark, wait_s, workers) is not None:  # sparkdl runs there
                sc.setJobGroup(
                    WARM_UP_GROUP, "sparkdl: warm up the JVM's Arrow stages", interruptOnCancel=True
                )
                spark.range(workers, numPartitions=workers).mapInArrow(_pass_through, "id long").collect()
        except Exception as exc:  # the fit checks again and reports it
            log.debug("warm-up of the new session failed: %s", exc)

    thread = threading.Thread(target=run, name="sparkdl-warm-up", daemon=True)
    thread.start()

    def stop() -> None:  # registered after PySpark's own exit hook, so it runs before it
        # Let it finish (seconds): a cancelled task reports to the driver after its job
        # ended, when the interpreter may be gone, and Spark logs that as an error.
        thread.join(_STOP_WAIT_S)
        if thread.is_alive():  # an executor that does not answer: cancel, and go
            groups = (environment_job_group(sc), WARM_UP_GROUP)
            for group in groups:
                sc.cancelJobGroup(group)
            # its killed tasks still report (their accumulators go to this interpreter's
            # server, which PySpark's hook closes next): wait, within bounds, for them to end
            deadline = time.monotonic() + _CANCEL_WAIT_S
            while _running_tasks(sc, groups) and time.monotonic() < deadline:
                time.sleep(0.1)

    atexit.register(stop)
    return thread


def _running_tasks(sc: Any, groups: tuple[str, ...]) -> int:
    """Tasks of the jobs of ``groups`` that Spark has not seen end (0 once each has reported)."""
    tracker = sc.statusTracker()
    running = 0
    for group in groups:
        for job in tracker.getJobIdsForGroup(group):
            info = tracker.getJobInfo(job)
            for stage in info.stageIds if info is not None else ():
                stage_info = tracker.getStageInfo(stage)
                running += stage_info.numActiveTasks if stage_info is not None else 0
    return running


def has_spare_cores(master: str, slots: int, cores: int | None = None) -> bool:
    """Whether warming up leaves the caller's own work its CPUs: a cluster's executors run
    on other machines; local mode (and ``local-cluster``) shares this one, where warming up
    pays only with a core beyond the executors' slots and one for the driver.

    Args:
        master: the Spark master URL; slots: its task slots (``defaultParallelism``);
        cores: this machine's usable cores (default: the process's CPU affinity).
    """
    if not master.startswith("local"):
        return True
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores >= slots + 2
