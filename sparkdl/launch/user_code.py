"""The user's own code on the workers, from the driver's side: what ``sparkdl.run`` and the
TorchDistributor share beside the pickling (:mod:`sparkdl.spark.shipping`): the workers'
output shown where nothing else shows it."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def showing_worker_output() -> Iterator[None]:
    """The processes' output on the driver's stdout for the run, where nothing else shows
    ``sparkdl.worker``'s INFO records (no logging configured: a notebook, a plain script)."""
    worker_log = logging.getLogger("sparkdl.worker")
    if logging.getLogger().handlers or worker_log.handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = worker_log.level
    worker_log.addHandler(handler)
    worker_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        worker_log.removeHandler(handler)
        worker_log.setLevel(level)
