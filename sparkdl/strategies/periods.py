"""How weight averaging's periods end: with every worker, or, with ``wa_backup_workers = b``,
with the first ``N - b`` to finish one (Chen et al.'s backup workers, applied to periods;
:mod:`sparkdl.strategies.weight_averaging`)."""

from __future__ import annotations

import torch.distributed as dist

from sparkdl.errors import ConfigError
from sparkdl.training.strategy import StrategyContext


class EveryWorker:
    """``wa_backup_workers = 0``: a period ends when every worker has finished it; no messages."""

    def finished(self, period: int) -> None:
        """This worker trained every step of ``period``."""

    def over(self, period: int) -> bool:
        """Whether ``period`` has ended for the workers still in it."""
        return False

    def forget(self, period: int) -> None:
        """Every worker has joined ``period``'s average."""


class FirstFinishers(EveryWorker):
    """A period ends once ``quorum`` workers finished it: one counter per period in the
    process group's store, its key naming the stage attempt so that a re-run stage never
    reads an earlier attempt's counts.

    Args:
        store: the process group's store (every rank reaches it).
        attempt: the stage attempt, the same on every rank.
        quorum: ``num_workers - wa_backup_workers``.
    """

    def __init__(self, store: dist.Store, attempt: int, quorum: int) -> None:
        self._store = store
        self._prefix = f"sparkdl/weight_averaging/attempt-{attempt}/period-"
        self._quorum = quorum

    def finished(self, period: int) -> None:
        self._store.add(f"{self._prefix}{period}", 1)

    def over(self, period: int) -> bool:
        return self._store.add(f"{self._prefix}{period}", 0) >= self._quorum  # one round trip

    def forget(self, period: int) -> None:
        self._store.delete_key(f"{self._prefix}{period}")


def period_ending(ctx: StrategyContext) -> EveryWorker:
    """How this run's periods end: with every worker, or with the first ``N - b``."""
    backups = ctx.config.weight_averaging.wa_backup_workers
    if not backups:
        return EveryWorker()
    if ctx.store is None:
        raise ConfigError(
            f"wa_backup_workers = {backups} needs the process group's store (StrategyContext.store), "
            "which the worker's assembly passes; set wa_backup_workers = 0 where there is none"
        )
    return FirstFinishers(ctx.store, ctx.attempt, ctx.world_size - backups)
