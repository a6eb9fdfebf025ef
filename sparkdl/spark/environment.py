"""Checks that the executors' Python can run sparkdl before the barrier stage starts.

An executor whose interpreter lacks sparkdl or torch fails every training task with an
import error, and Spark re-runs the stage several times before giving up. One tiny
non-barrier task per worker asks an executor which interpreter it runs and whether torch
and sparkdl import there; a mismatch with the driver is reported once, naming
``PYSPARK_PYTHON``. On a fresh session those tasks also start the Python workers the
training stage runs in, and import what it imports there, while the driver checks the model.

The function shipped to the executor uses the standard library only and travels by value
(its code, not a reference to this module), so it runs where sparkdl cannot be imported;
it catches every import error itself and returns it as data, so the task never fails and
is never retried. A passing check is remembered per application.
"""

from __future__ import annotations

import builtins
import json
import logging
import re
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparkdl import process
from sparkdl.errors import ExecutorEnvironmentError
from sparkdl.spark.cluster import is_connect

log = logging.getLogger(__name__)

JOB_GROUP_PREFIX = "sparkdl-environment-check"
_CANCEL_WAIT_S = 10.0
_EXCERPT_LIMIT = 600
_PYTHON_ERROR = re.compile(r"^\s*((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception): .+)$", re.MULTILINE)

_passed: dict[str, Interpreter] = {}  # applicationId -> the executors' interpreter


def _forget_passed() -> None:
    with _lock:
        _passed.clear()


process.keep(
    "spark.environment",
    "driver",
    "the applications whose executors passed the Python check (it runs once per application)",
    "the application (its SparkContext)",
    _forget_passed,
)
_lock = threading.Lock()


@dataclass(frozen=True)
class Interpreter:
    """One Python interpreter and what it can import.

    Attributes:
        executable: ``sys.executable``; python: its version, e.g. "3.11.7".
        torch, sparkdl: the version that imports ("" when it does not import).
        torch_error, sparkdl_error: why the import failed ("" when it did not).
    """

    executable: str
    python: str
    torch: str = ""
    torch_error: str = ""
    sparkdl: str = ""
    sparkdl_error: str = ""

    @classmethod
    def from_json(cls, text: str) -> Interpreter:
        data = json.loads(text)
        return cls(**{key: str(data.get(key, "")) for key in cls.__dataclass_fields__})


def _interpreter_facts() -> str:
    """This interpreter and its imports, as JSON (runs on an executor, and on the driver).

    Only the standard library, imported inside: it is shipped by value and must run where
    sparkdl is missing. Import errors are returned, never raised, so the task cannot fail.
    """
    import importlib
    import json
    import sys

    facts = {"executable": sys.executable, "python": ".".join(str(v) for v in sys.version_info[:3])}
    # sparkdl's package imports lazily: import what a training task runs, not just the name
    for name, needed in (("torch", "torch"), ("sparkdl", "sparkdl.spark.fit_task")):
        try:
            importlib.import_module(needed)
            module = sys.modules[name]
            facts[name], facts[name + "_error"] = str(getattr(module, "__version__", "unknown")), ""
        except Exception as exc:  # the report must come back as data, not as a task failure
            facts[name], facts[name + "_error"] = "", f"{type(exc).__name__}: {exc}"
    return json.dumps(facts)


def _probe_row(_row: Any) -> str:
    """The check's task, one row per worker: the facts of its interpreter. A SQL Python UDF
    (pickled rows, not Arrow: it must answer where pyarrow is missing too), so that it
    starts the Python workers of SQL stages, which the training stage (``mapInArrow``)
    then reuses; an RDD task would start another pool of workers, which it never uses."""
    return _interpreter_facts()


def _by_value(fn: Callable[..., Any], **shipped: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` that cloudpickle ships by value (its code, and the ``shipped``
    functions it calls): its module name is not importable, so the pickle holds no
    reference to sparkdl."""
    clone = types.FunctionType(
        fn.__code__, {"__builtins__": builtins, **shipped}, fn.__name__, fn.__defaults__
    )
    clone.__module__ = "__sparkdl_environment_probe__"
    clone.__qualname__ = fn.__qualname__
    return clone


SHIPPED_PROBE = _by_value(_probe_row, _interpreter_facts=_by_value(_interpreter_facts))


def driver_interpreter() -> Interpreter:
    """This process's interpreter, described as an executor's is."""
    return Interpreter.from_json(_interpreter_facts())


def environment_problems(driver: Interpreter, executor: Interpreter) -> list[str]:
    """What the executors' interpreter lacks to run the driver's training, in words."""
    problems = []
    if _minor(executor.python) != _minor(driver.python):
        problems.append(
            f"Python {executor.python} differs from the driver's {driver.python} "
            "(cloudpickled functions need the same major.minor)"
        )
    if not executor.torch:
        problems.append(f"torch cannot be imported ({executor.torch_error})")
    elif _minor(executor.torch) != _minor(driver.torch):
        problems.append(f"torch is {executor.torch} but the driver has {driver.torch}")
    if not executor.sparkdl:
        problems.append(f"sparkdl cannot be imported ({executor.sparkdl_error})")
    return problems


def mismatch_message(driver: Interpreter, executor: Interpreter, problems: list[str], setting: str) -> str:
    """The error for executors that cannot run sparkdl; ``setting``: PYSPARK_PYTHON's value."""
    return (
        f"executors run {executor.executable} ({executor.python}), where {'; '.join(problems)}; "
        f"set PYSPARK_PYTHON (now {setting!r}) to an interpreter with sparkdl and torch "
        f"{driver.torch} installed (the driver runs {driver.executable}, Python {driver.python}), "
        "before the SparkContext starts, or ship one to the executors: bash scripts/pack_env.sh, then "
        "spark.archives = 'dist/sparkdl-env.tar.gz#environment' and spark.pyspark.python = "
        "'./environment/bin/python' (docs/guide/install.md)"
    )


def environment_job_group(sc: Any) -> str:
    """The job group of the check on ``sc`` (one per application)."""
    return f"{JOB_GROUP_PREFIX}-{sc.applicationId}"


def check_executor_environment(spark: Any, timeout_s: float, workers: int = 1) -> Interpreter | None:
    """Run tiny tasks on the executors and compare their Python with the driver's.

    One task per worker of the fit to come: on a fresh session this starts the Python
    workers the training stage then reuses (warm, with sparkdl imported), rather than the
    stage starting them.

    Skipped on Spark Connect (the client is not the driver); a pass is remembered for the
    application, so later fits do not pay for it again.

    Args:
        spark: the SparkSession of the fit.
        timeout_s: how long to wait for the tasks; past it the job is cancelled and the
            check skipped with a warning (a slow executor is not a wrong one).
        workers: how many tasks to run at once.

    Returns:
        the executors' interpreter, or None when the check was skipped.

    Raises:
        ExecutorEnvironmentError: the executors cannot run sparkdl: wrong interpreter,
            torch or sparkdl missing, or Python workers that do not start.
    """
    if is_connect(spark):
        log.debug("Spark Connect session: the executors' Python is not checked")
        return None
    sc = spark.sparkContext
    with _lock:
        if sc.applicationId in _passed:
            return _passed[sc.applicationId]
        driver = driver_interpreter()
        executor = _run_probe(spark, timeout_s, driver, workers)
        if executor is None:
            return None
        problems = environment_problems(driver, executor)
        if problems:
            raise ExecutorEnvironmentError(mismatch_message(driver, executor, problems, sc.pythonExec))
        if executor.sparkdl != driver.sparkdl:
            log.warning("executors run sparkdl %s, the driver %s", executor.sparkdl, driver.sparkdl)
        _passed[sc.applicationId] = executor
        return executor


def _run_probe(spark: Any, timeout_s: float, driver: Interpreter, tasks: int = 1) -> Interpreter | None:
    """The executor's answer; None when none came within ``timeout_s`` (job cancelled)."""
    from pyspark import InheritableThread
    from pyspark.sql.functions import udf

    sc = spark.sparkContext
    probe = udf(SHIPPED_PROBE, "string", useArrow=False)

    group = environment_job_group(sc)
    outcome: dict[str, Any] = {}

    def job() -> None:
        try:
            sc.setJobGroup(group, "sparkdl fit: check the executors' Python", interruptOnCancel=True)
            sc.setLocalProperty("callSite.short", "sparkdl environment check")  # the stage's name
            rows = spark.range(tasks, numPartitions=tasks).select(probe("id")).collect()
            outcome["rows"] = [row[0] for row in rows]
        except Exception as exc:  # handed to the caller's thread below
            outcome["error"] = exc

    thread = InheritableThread(job, name="sparkdl-environment-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        sc.cancelJobGroup(group)
        thread.join(_CANCEL_WAIT_S)
        log.warning(
            "no executor answered the Python environment check within %.0fs "
            "(runtime.executor_wait_timeout_s); going on without it",
            timeout_s,
        )
        return None
    if "error" in outcome:
        error = outcome["error"]
        raise ExecutorEnvironmentError(
            f"executors could not start Python {sc.pythonExec!r} (PYSPARK_PYTHON) for a one-task "
            f"check: {failure_excerpt(str(error))}; set PYSPARK_PYTHON to an interpreter with sparkdl and "
            f"torch {driver.torch} installed (the driver runs {driver.executable}, Python "
            f"{driver.python}), before the SparkContext starts"
        ) from error
    answers = [Interpreter.from_json(row) for row in outcome["rows"]]
    return next((a for a in answers if environment_problems(driver, a)), answers[0])  # the worst


def failure_excerpt(text: str) -> str:
    """The line of a Spark job failure that says why: the last Python error, else the
    first JVM exception below the Py4J wrapper, else the abort line, else the first line."""
    errors = _PYTHON_ERROR.findall(text)
    python_errors = [m for m in errors if not m.startswith(("org.", "java.", "py4j."))]
    jvm_errors = [m for m in errors if m.startswith(("org.", "java.")) and "Job aborted" not in m]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    aborted = [line for line in lines if "Job aborted" in line]
    if python_errors:
        line = python_errors[-1]
    else:
        line = (jvm_errors or aborted or lines or [""])[0]
    return line.lstrip(": ")[:_EXCERPT_LIMIT]


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+", 1)[0].split(".")[:2])


#: Signs of running out of one kind of memory in a failure's text, and what to change.
_MEMORY_SIGNS = (
    (
        ("OutOfDirectMemoryError", "Direct buffer memory"),
        "the JVM ran out of direct (off-heap) memory: raise spark.executor.memoryOverhead "
        "(spark.driver.memoryOverhead for the driver), or send less per record batch "
        "(spark.sql.execution.arrow.maxRecordsPerBatch)",
    ),
    (
        ("java.lang.OutOfMemoryError", "Java heap space"),
        "the JVM ran out of heap: raise spark.driver.memory (local mode runs the executors in the "
        "driver's JVM; set it before the session starts) or spark.executor.memory on a cluster",
    ),
    (
        ("CUDA out of memory", "OutOfMemoryError: CUDA"),
        'the GPU ran out of memory: lower batch_size, train in precision = "bf16", or split the '
        'model across the workers with strategy = "fsdp", "pipeline" or "tensor"',
    ),
    (
        ("DefaultCPUAllocator: can't allocate memory", "Python worker exited unexpectedly", "MemoryError"),
        "a Python worker ran out of memory (or was killed by the system for it): give executors more "
        "memory (spark.executor.pyspark.memory caps it when set), run fewer workers per host, or split "
        'the model across the workers with strategy = "fsdp", "pipeline" or "tensor"',
    ),
)


def memory_hint(text: str) -> str:
    """What ran out and which setting to change, when ``text`` (a failure) shows a memory
    error; "" otherwise."""
    for signs, hint in _MEMORY_SIGNS:
        if any(sign in text for sign in signs):
            return hint
    return ""
