"""What the test workers' fork server imports once (see tests/workers.py), so that a worker
forked from it imports nothing heavy again: torch, its process groups, and what building a
first optimizer imports lazily (about 800 modules); pyarrow and pandas (pyarrow imports
pandas on a worker's first batch); sparkdl's worker side and the tests' reference helpers.

Then everything imported is moved out of the garbage collector's sight (``gc.freeze``), as
sparkdl's PySpark daemon does: a worker's teardown ``gc.collect()`` then walks the worker's
own objects only. The one thread these imports start, pyarrow's jemalloc background thread,
is fork-safe (jemalloc's fork handlers; a forked child starts its own when it needs one)."""

import gc

import pandas  # noqa: F401
import pyarrow  # noqa: F401
import torch
import torch.distributed

import sparkdl.spark.ps_host
import sparkdl.worker.assembly
import sparkdl.worker.own_loop  # noqa: F401
import tests.reference  # noqa: F401

torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
gc.collect()
gc.freeze()
