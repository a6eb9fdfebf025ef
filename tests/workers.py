"""Worker processes for the unit tests, started the way Spark starts its Python workers:
forked from a server that imported torch once (``forkserver``), so a worker starts in a
fraction of a second instead of paying torch's, pyarrow's and sparkdl's imports (about 4 s
of CPU) again.

The server is started by the first test that asks for a worker and lives for the session;
it sees the environment of that moment (conftest.py sets what the workers need at import).
A test whose worker must start from a fresh interpreter, e.g. to measure its memory from
zero or to read an environment variable at start-up, asks for ``fresh=True`` (spawn).
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import BaseContext

#: Imported by the server before it forks a worker: torch, pyarrow, sparkdl's worker side
#: (tests/preloaded.py says what and why), then frozen out of the collector's sight.
PRELOAD = ["tests.preloaded"]


def worker_context(fresh: bool = False) -> BaseContext:
    """The multiprocessing context the unit tests start workers with."""
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def keep_built_strategies() -> list:
    """In a worker process: from now on, every strategy the worker builder creates is also
    appended to the returned list (``run_worker`` returns rank 0's weights only; a test that
    needs every rank's reads them from its strategy)."""
    import sparkdl.worker.builder as builder

    built: list = []
    create = builder.create_strategy

    def keep(ctx):
        built.append(create(ctx))
        return built[-1]

    builder.create_strategy = keep
    return built
