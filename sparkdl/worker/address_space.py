"""Python workers under ``spark.executor.pyspark.memory``: reserve no address space ahead of use.

PySpark's worker sets the setting as the process's address-space limit (``RLIMIT_AS``)
before each task, and that limit counts every mapping, touched or not. Two allocators
reserve address space they may never use: pyarrow's default pool (mimalloc) reserves 1 GiB
per process at its first allocation, and glibc gives each new thread an arena of up to
64 MB (eight per core). Measured on a pipeline stage of 50M parameters under Adam
(``tests/spark/memory_limit_drill.py``, 4 workers): a peak address space of 2.9-3.2 GB with
both against 2.0-2.2 GB with neither, for the same 1.2-1.5 GB resident; a limit of 2.6 GB
failed the first.

Both choices are made when a process starts (pyarrow fixes its pool at import, before a
task's code runs), so they go into the executors' environment: :data:`UNDER_A_LIMIT` (set
by :func:`sparkdl.session` where the session sets ``spark.executor.pyspark.memory``), and
sparkdl's worker daemon applies them before it forks the workers. Without a limit nothing
changes: the reservations cost nothing there. No pyarrow import here: the daemon imports this.
"""

from __future__ import annotations

import ctypes
import os
import platform

#: The executors' environment under a limit: Arrow allocates from the system allocator, and
#: glibc keeps two arenas (threads share them).
UNDER_A_LIMIT = {"ARROW_DEFAULT_MEMORY_POOL": "system", "MALLOC_ARENA_MAX": "2"}

M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)
LIMIT_VARIABLE = "PYSPARK_EXECUTOR_MEMORY_MB"  # how Spark tells a Python worker its limit


def limited() -> bool:
    """Whether Spark gives this executor's Python workers a memory limit."""
    return int(os.environ.get(LIMIT_VARIABLE, "-1") or -1) > 0


def reserve_less_before_forking() -> bool:
    """In the worker daemon, before its first fork: where the workers will be limited, set
    :data:`UNDER_A_LIMIT` for them (values the environment already has are kept; glibc's
    cap through ``mallopt``, since this process's allocator has started). Returns whether
    it did."""
    if not limited():
        return False
    for name, value in UNDER_A_LIMIT.items():
        os.environ.setdefault(name, value)
    if platform.libc_ver()[0] == "glibc":
        try:
            ctypes.CDLL(None).mallopt(M_ARENA_MAX, int(os.environ["MALLOC_ARENA_MAX"]))
        except (OSError, AttributeError, ValueError):  # no mallopt, or a value that is no number
            pass
    return True
