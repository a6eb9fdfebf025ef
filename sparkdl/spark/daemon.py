"""PySpark's Python worker daemon, with torch imported once before it forks the workers.

Spark starts one daemon per executor (``python -m <spark.python.daemon.module>``) and
forks a Python worker from it for each task slot. With PySpark's own daemon every new
worker imports torch itself: about a second of CPU each, paid again by every worker of a
fresh session's first fit (measured in ``benchmarks/bench_first_fit.py``). Imported here,
before the fork, the workers inherit it.

Before forking, everything imported so far is moved out of the garbage collector's sight
(``gc.freeze``): a worker's ``gc.collect()`` (its teardown runs one, to free DDP's reducer
while the process group lives) then looks at the fit's own objects only, 15 ms instead of
160 ms, and never writes to the pages it shares with the daemon.

Only modules that start no threads at import are imported (PySpark's daemon imports its
worker after the fork for that reason: pyarrow and pandas start threads): torch, and the
modules its optimizers import on first use, start none that a forked child relies on.
:func:`sparkdl.session` sets ``spark.python.daemon.module`` to this module for local masters,
where the executors run
the driver's interpreter; on a cluster set it yourself once sparkdl is installed on every
executor.
"""

from __future__ import annotations

import gc

import torch  # imported for the forked workers
import torch.distributed
from pyspark.daemon import manager

from sparkdl.worker.address_space import reserve_less_before_forking


def _warm() -> None:
    """Import what a worker's first steps import lazily: building the first optimizer
    imports about 800 modules (torch's compiler stack, sympy), 0.7 s; it starts no thread."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _prepare() -> None:
    """Import and warm up what every worker needs, then freeze it for the forks."""
    _warm()
    gc.collect()
    gc.freeze()


if __name__ == "__main__":
    reserve_less_before_forking()  # where spark.executor.pyspark.memory limits the workers
    _prepare()
    manager()
