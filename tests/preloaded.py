"""What the test workers' fork server imports once (see tests/workers.py), so that a worker
forked from it imports nothing heavy again: torch and what its first optimizer imports
lazily, pyarrow and pandas (pyarrow imports pandas on a worker's first batch), sparkdl's
worker side and the tests' reference helpers.

Then it prepares as sparkdl's PySpark daemon does (:mod:`sparkdl.spark.daemon`): the first
optimizer built, and everything imported moved out of the garbage collector's sight, so a
worker's teardown ``gc.collect()`` walks the worker's own objects only. The one thread these
imports start, pyarrow's jemalloc background thread, is fork-safe (jemalloc's fork
handlers; a forked child starts its own when it needs one)."""

import pandas  # noqa: F401
import pyarrow  # noqa: F401

import sparkdl.spark.ps_host
import sparkdl.worker.assembly
import sparkdl.worker.own_loop  # noqa: F401
import tests.reference  # noqa: F401
from sparkdl.spark import daemon

daemon._prepare()  # last: it freezes what the imports above brought in
