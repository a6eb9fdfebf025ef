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
import importlib.metadata
import re
import sys
import zipfile


def prefer_installed_pyspark(path: list[str]) -> list[str]:
    """``path`` with Spark's ``pyspark.zip`` and ``py4j-*-src.zip`` moved to its end where the
    same version of each is installed (a pip-installed PySpark, local masters' case).

    Spark puts the zips first on its workers' path, and Python compiles a module from a zip
    at every import (zipimport writes no ``.pyc``): each worker of a fresh session spent about
    a second recompiling PySpark's modules, and each daemon more. The installed copy's
    compiled files serve the same code. A zip whose version differs from the installed one's,
    or with nothing installed, stays first: the executors' Spark decides."""
    wanted = []
    for entry in path:
        name = entry.rsplit("/", 1)[-1]
        if name == "pyspark.zip":
            zipped, package = _zipped_pyspark_version(entry), "pyspark"
        elif name.startswith("py4j-") and name.endswith("-src.zip"):
            zipped, package = name[len("py4j-") : -len("-src.zip")], "py4j"
        else:
            continue
        try:
            installed = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        if zipped and zipped == installed:
            wanted.append(entry)
    return [e for e in path if e not in wanted] + wanted


def _zipped_pyspark_version(zipped: str) -> str:
    try:
        with zipfile.ZipFile(zipped) as archive:
            text = archive.read("pyspark/version.py").decode()
    except (OSError, KeyError, zipfile.BadZipFile):
        return ""
    found = re.search(r"__version__[^=]*=\s*['\"]([^'\"]+)['\"]", text)
    return found.group(1) if found else ""


sys.path[:] = prefer_installed_pyspark(sys.path)  # before anything imports pyspark

import torch  # noqa: E402  (imported for the forked workers)
import torch.distributed  # noqa: E402
from pyspark.daemon import manager  # noqa: E402

from sparkdl.worker.address_space import reserve_less_before_forking  # noqa: E402


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
