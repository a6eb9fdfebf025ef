"""A worker's teardown: bounded, in order, and leaving the process as it found it.

The worker's exit stack (:func:`sparkdl.worker.assembly.run_worker`) runs these in reverse
of assembly, on success and on error alike: the :class:`TeardownWatchdog` is armed first
and bounds everything after it; the strategy lets go of DDP's reducer
(:func:`close_strategy`) while its process group lives; gloo's threads get the GIL to drop
their last works before the groups are destroyed (:func:`release_process_groups`); the
socket interface chosen for gloo and NCCL is restored (:func:`socket_interface`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import os
import sys
import time
from collections.abc import Iterator

from sparkdl.comm.network_interfaces import interface_of
from sparkdl.comm.rendezvous import ProcessGroups
from sparkdl.training.strategy import SyncStrategy

log = logging.getLogger(__name__)

#: How long gloo's threads get, with the GIL released, to drop their last works.
_SETTLE_S = 0.05


def close_strategy(strategy: SyncStrategy) -> None:
    strategy.close()
    gc.collect()  # DDP's reducer may sit in a reference cycle: free it while its group lives


def release_process_groups(groups: ProcessGroups) -> None:
    """Give gloo's threads the GIL to drop their last works, then destroy the groups."""
    time.sleep(_SETTLE_S)  # releases the GIL
    groups.destroy()


class TeardownWatchdog:
    """Bounds a worker's teardown: if releasing its resources takes longer than
    ``timeout_s`` (``runtime.teardown_timeout_s``), the worker process ends with every
    thread's stack on stderr (the executor's log), rather than hang its task forever.

    Python cannot run a timer while another thread holds the GIL in a destructor, so
    the bound is faulthandler's C-level timer; it is cancelled when the teardown ends.
    """

    def __init__(self, timeout_s: float, rank: int) -> None:
        self._timeout_s = timeout_s
        self._rank = rank

    def arm(self) -> None:
        """Start the clock; the exit stack cancels it once every resource is released."""
        log.debug(
            "rank %d: teardown bounded by runtime.teardown_timeout_s = %gs", self._rank, self._timeout_s
        )
        faulthandler.dump_traceback_later(self._timeout_s, exit=True, file=sys.stderr)

    @staticmethod
    def disarm() -> None:
        faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def socket_interface(setting: str, host: str) -> Iterator[None]:
    """Point gloo and NCCL at an interface for this worker only; restore the environment.

    The interface: ``setting`` (``runtime.network_interface``) when given; else, for each of
    ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` on its own, the one the environment
    already names, or the one holding ``host``, the address Spark gave this executor (left
    to torch where no interface holds it): torch's own choice follows the host name, which
    many hosts resolve to loopback, where ranks on other hosts cannot connect. Naming one
    in the environment (NCCL's, for InfiniBand) leaves the other chosen as ever.
    """
    names = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    saved = {name: os.environ.get(name) for name in names}
    detected: str | None = None
    for name in names:
        interface = setting or saved[name]
        if not interface:
            detected = interface_of(host) if detected is None else detected
            interface = detected or ""
        if interface:
            os.environ[name] = interface
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
