"""Checks that the Spark cluster can run a barrier stage of ``num_workers`` tasks.

Spark itself would wait for free slots and fail only after many minutes
(``spark.scheduler.barrier.maxConcurrentTasksCheck.*``); we look first and fail in
seconds with an error that says what to change.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from sparkdl import process
from sparkdl.errors import ClusterConfigError

log = logging.getLogger(__name__)

BARRIER_TIMEOUT_KEY = "spark.barrier.sync.timeout"
_YEAR_S = 365 * 24 * 3600


def is_connect(spark: Any) -> bool:
    """True for a Spark Connect session (no JVM SparkContext in this process)."""
    return "connect" in type(spark).__module__


def check_cluster(
    spark: Any, num_workers: int, wait_s: float, collective_timeout_s: float, profile: Any = None
) -> None:
    """Raise ClusterConfigError unless ``num_workers`` barrier tasks can run at once
    (with ``profile``: the training stage's own resource profile, e.g. one GPU per task)."""
    if is_connect(spark):
        return
    sc = spark.sparkContext
    conf = sc.getConf()
    master = sc.master
    if conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true" and not master.startswith(
        "local"
    ):
        raise ClusterConfigError(
            "spark.dynamicAllocation.enabled = true, but barrier-mode training needs a fixed set "
            "of executors; start the session with spark.dynamicAllocation.enabled=false"
        )
    barrier_timeout = parse_seconds(conf.get(BARRIER_TIMEOUT_KEY, "365d"))
    if barrier_timeout > 10 * collective_timeout_s:
        log.warning(
            "%s is %ss: a worker stuck before a barrier is only noticed after that long; "
            "set it near runtime.collective_timeout_s (%ss) when building the session",
            BARRIER_TIMEOUT_KEY,
            int(barrier_timeout),
            int(collective_timeout_s),
        )
    if profile is not None:  # what submitting the stage would do; its slots are counted below
        sc._jsc.sc().resourceProfileManager().addResourceProfile(profile._java_resource_profile)
    wait_for_slots(lambda: max_concurrent_tasks(sc, profile), num_workers, wait_s, master)


def wait_for_slots(
    probe: Callable[[], int],
    required: int,
    wait_s: float,
    master: str,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Poll ``probe`` until it reports ``required`` slots or ``wait_s`` passes (local
    mode at once: its slots are fixed when the session starts)."""
    local = is_local_mode(master)
    available = poll_slots(probe, required, wait_s, clock, sleep, stop=lambda _: local)
    if available >= required:
        return available
    if local:
        raise ClusterConfigError(
            f"num_workers = {required} but local mode ({master}) has only {available} free task "
            f"slot(s), and its slots never grow; barrier mode needs all workers at once. Lower "
            f"num_workers to {max(available, 1)}, or start the session with local[{required}] "
            f"(or more)"
        )
    raise ClusterConfigError(
        f"num_workers = {required} but the cluster ({master}) has only {available} free "
        f"task slot(s) after waiting {wait_s:.0f}s; barrier mode needs all workers at "
        f"once. Lower num_workers to {max(available, 1)}, add executors/cores, lower "
        "spark.task.cpus, or raise runtime.executor_wait_timeout_s if executors are "
        "still starting"
    )


def poll_slots(
    probe: Callable[[], int],
    required: int,
    wait_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    stop: Callable[[int], bool] = lambda _: False,
) -> int:
    """The slots ``probe`` counts, polled every 0.5 s until they reach ``required``,
    ``stop(available)`` holds, or ``wait_s`` passes: the last count."""
    deadline = clock() + wait_s
    while True:
        available = probe()
        if available >= required or stop(available) or clock() >= deadline:
            return available
        sleep(min(0.5, max(deadline - clock(), 0.0)))


def is_local_mode(master: str) -> bool:
    """``local``, ``local[N]``, ``local[*]``, ``local[N,F]``: one JVM whose slots are fixed
    (``local-cluster`` starts executors that come up over time)."""
    return master == "local" or master.startswith("local[")


def max_concurrent_tasks(sc: Any, profile: Any = None) -> int:
    """Task slots for ``profile`` (default: the default resource profile), as Spark's
    barrier check counts them."""
    jsc = sc._jsc.sc()
    if profile is None:
        java_profile = jsc.resourceProfileManager().defaultResourceProfile()
    else:
        java_profile = profile._java_resource_profile  # registered by check_cluster
    return int(jsc.maxNumConcurrentTasks(java_profile))


def executor_hosts(sc: Any) -> set[str]:
    """The hosts the cluster's live executors run on, as Spark's status store lists them (none
    in local mode, where the driver, left out, runs the tasks)."""
    executors = sc._jsc.sc().statusStore().executorList(True)  # active only
    summaries = [executors.apply(i) for i in range(executors.size())]
    return {str(e.hostPort()).rsplit(":", 1)[0] for e in summaries if str(e.id()) != "driver"}


class ExecutorAddresses:
    """The addresses the fits' tasks connect to the driver's servers from, as Spark knows
    them: every live executor's host resolved to its addresses, and the driver's own (local
    mode's tasks run in the driver's JVM), of whichever SparkContext is active when it reads
    (one view for the process: the weights server outlives a context). A live view for the
    servers' listeners (:class:`~sparkdl.wire.listener.ConnectionListener`'s ``known``),
    which reserve some of their handshake places for these addresses; it only grows.

    A lookup reads a set and never waits: a miss more than :attr:`REFRESH_S` after the last
    reading schedules one new reading on a thread of its own, so an executor that dynamic
    allocation adds is known a moment after its first connection, and a flood from other
    addresses costs one reading of Spark's status store (and of DNS) every :attr:`REFRESH_S`.
    """

    REFRESH_S = 2.0

    def __init__(self, context: Callable[[], Any]) -> None:
        self._context = context  # the active SparkContext, or None
        self._addresses: frozenset[str] = frozenset()
        self._read_at = -math.inf
        self._lock = threading.Lock()
        self._resolved: dict[str, set[str]] = {}  # host -> its addresses, resolved once

    def __contains__(self, address: object) -> bool:
        if address in self._addresses:
            return True
        with self._lock:  # one reading at a time, whatever the burst of misses
            stale = time.monotonic() - self._read_at > self.REFRESH_S
            if stale:
                self._read_at = math.inf  # scheduled: no other miss starts one
        if stale:  # not "sparkdl-" named: it serves the process's view, not one fit
            threading.Thread(target=self.refresh, name="executor-addresses", daemon=True).start()
        return False

    def forget(self) -> None:
        """Drop every address read so far (the next lookup reads Spark again)."""
        with self._lock:
            self._addresses, self._resolved, self._read_at = frozenset(), {}, -math.inf

    def refresh(self) -> None:
        """Read the executors' hosts from Spark's status store and add their addresses."""
        hosts: set[str] = set()
        try:
            sc = self._context()
            if sc is not None:
                hosts.add(str(sc.getConf().get("spark.driver.host", "127.0.0.1")))
                hosts |= executor_hosts(sc)
        except Exception as exc:  # the context is stopping: keep what was known
            log.debug("cannot read the executors from Spark's status store: %s", exc)
        for host in hosts - set(self._resolved):
            self._resolved[host] = _resolved({host})
        self._addresses = self._addresses.union(*(self._resolved[h] for h in hosts))
        with self._lock:
            self._read_at = time.monotonic()


def _resolved(hosts: set[str]) -> set[str]:
    """``hosts`` and every address they resolve to (a loopback one brings loopback's others:
    a local task may connect from 127.0.0.1 to a driver bound to 127.0.1.1)."""
    addresses = set(hosts)
    for host in hosts:
        try:
            found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
            addresses |= {str(info[4][0]) for info in found}
        except OSError:
            continue
    if any(a.startswith("127.") or a == "::1" for a in addresses):
        addresses |= {"127.0.0.1", "::1"}
    return addresses


def _active_context() -> Any:
    from pyspark import SparkContext

    return SparkContext._active_spark_context


_KNOWN = ExecutorAddresses(_active_context)
process.keep(
    "spark.executor_addresses",
    "driver",
    "the executors' addresses, for which the driver's listeners reserve handshake places (it only grows)",
    "the driver process",
    _KNOWN.forget,
)


def executor_addresses(spark: Any = None) -> ExecutorAddresses | None:
    """The process's :class:`ExecutorAddresses`, read now if it never was; None over Spark
    Connect (whose executors never reach this process)."""
    if spark is not None and is_connect(spark):
        return None
    if not _KNOWN._addresses:
        _KNOWN.refresh()
    return _KNOWN


def parse_seconds(text: str) -> float:
    """A Spark duration (``120s``, ``2min``, ``500ms``, ``365d``, plain seconds) in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit) and text[: -len(unit)].replace(".", "", 1).isdigit():
            return float(text[: -len(unit)]) * units[unit]
    try:
        return float(text)
    except ValueError:
        return _YEAR_S


@contextlib.contextmanager
def own_local_properties(spark: Any) -> Iterator[None]:
    """Inside, this thread's Spark local properties (its job group, description, ...) are a
    copy of its own: what it sets there reaches no other thread, and the caller's are back
    after. PySpark's tuning (``CrossValidator``, ``TrainValidationSplit`` with
    ``parallelism`` > 1) gives all its trial threads one properties object
    (``inheritable_thread_target(session)`` clones once, then sets that one clone in every
    thread), so a fit setting its job group there would set it for the trials beside it,
    whose stages would then run in its group (nothing over Spark Connect)."""
    if is_connect(spark):
        yield
        return
    context = spark.sparkContext._jsc.sc()
    shared = context.getLocalProperties()
    context.setLocalProperties(shared.clone())
    try:
        yield
    finally:
        context.setLocalProperties(shared)


@contextlib.contextmanager
def described(spark: Any, text: str) -> Iterator[None]:
    """The Spark UI's description of the jobs started inside; the caller's restored after
    (nothing over Spark Connect, whose client has no SparkContext)."""
    if is_connect(spark):
        yield
        return
    sc = spark.sparkContext
    previous = sc.getLocalProperty("spark.job.description")
    sc.setJobDescription(text)
    try:
        yield
    finally:
        sc.setLocalProperty("spark.job.description", previous)


def driver_host(spark: Any) -> str:
    """The driver's address that executors reach (where its servers listen)."""
    return str(spark.conf.get("spark.driver.host", "127.0.0.1"))
