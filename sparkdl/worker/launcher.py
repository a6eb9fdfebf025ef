"""Launching a user's training code as torchrun would: the processes, their environment,
the store they meet at, and what happens when one of them fails.

This is the executor (and local-mode driver) side of :class:`sparkdl.TorchDistributor`.
No Spark here: the caller says which ranks run where and how the agents meet.

How it differs from torchrun, on purpose:

- The store the user's ``init_process_group`` meets at is hosted by the *agent* (the
  barrier task, or the driver in local mode) on a socket bound with port 0 before any
  child starts, and the children join it as clients (``TORCHELASTIC_USE_AGENT_STORE``):
  there is no "pick a free port, close it, let rank 0 rebind it" race.
- A child that fails stops every other child of the run once noticed (every 0.2 s): the failing
  agent marks the run failed in the store, every agent polls for that mark
  (:class:`FailureBoard`) and terminates its own child (its whole process group).
- Every child runs in its own session, dies with its agent (``PR_SET_PDEATHSIG``), and
  its output is relayed line by line (to the agent's log and the driver); the last lines
  of its stderr go into the error when it fails.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import IO

import torch.distributed as dist

log = logging.getLogger(__name__)

#: How often an agent looks at its child and at the failure mark.
POLL_S = 0.2
#: How long a child has to exit after SIGTERM before it is killed.
TERMINATE_GRACE_S = 10.0
#: Lines of a failed child's stderr kept for its error.
TAIL_LINES = 20
#: Characters of one relayed output line (a progress bar can write very long ones).
MAX_LINE_CHARS = 2000

#: The store key the first failing rank claims (its rank), written by the child itself where
#: it can (:mod:`sparkdl.worker.child`), else by its agent.
FAILED_KEY = "sparkdl/launch/failed"
#: Set by rank 0's agent once its child succeeded: the store vanishing after it is no loss.
_LEAD_DONE_KEY = "sparkdl/launch/lead-done"


@dataclass(frozen=True)
class Rendezvous:
    """Where the children of one run meet (torchrun's ``MASTER_ADDR:MASTER_PORT``).

    Attributes:
        host, port: the agent store's address.
        run_id: names the run (``TORCHELASTIC_RUN_ID``), the same on every rank.
        attempt: the Spark stage attempt (``TORCHELASTIC_RESTART_COUNT``).
    """

    host: str
    port: int
    run_id: str
    attempt: int = 0


@dataclass(frozen=True)
class Slot:
    """One child's place in the run.

    Attributes:
        rank, world_size: its global rank and the number of processes.
        local_rank, local_world_size: its rank among the processes of its host, and their number.
        group_rank, group_world_size: its agent's rank and the number of agents (torchrun's nodes).
        gpus: ``CUDA_VISIBLE_DEVICES`` for it (``()``: no GPU, ``None``: leave it as it is).
        threads: ``OMP_NUM_THREADS`` (the CPU cores Spark gave its task).
    """

    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0
    group_world_size: int = 1
    gpus: tuple[str, ...] | None = ()
    threads: int = 1


def torchrun_env(slot: Slot, rendezvous: Rendezvous) -> dict[str, str]:
    """The environment torchrun gives a worker, for ``slot`` meeting at ``rendezvous``
    (pure): code written for torchrun or PySpark's TorchDistributor finds what it reads."""
    env = {
        "MASTER_ADDR": rendezvous.host,
        "MASTER_PORT": str(rendezvous.port),
        "RANK": str(slot.rank),
        "WORLD_SIZE": str(slot.world_size),
        "LOCAL_RANK": str(slot.local_rank),
        "LOCAL_WORLD_SIZE": str(slot.local_world_size),
        "GROUP_RANK": str(slot.group_rank),
        "GROUP_WORLD_SIZE": str(slot.group_world_size),
        "NODE_RANK": str(slot.group_rank),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(slot.rank),
        "ROLE_WORLD_SIZE": str(slot.world_size),
        "TORCHELASTIC_RUN_ID": rendezvous.run_id,
        "TORCHELASTIC_RESTART_COUNT": str(rendezvous.attempt),
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": str(max(1, slot.threads)),
        "PYTHONUNBUFFERED": "1",
    }
    if slot.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(slot.gpus)
    return env


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the agent store at ``host:port`` (the other agents' view of the run)."""
    return dist.TCPStore(host, port, None, is_master=False, timeout=timedelta(seconds=timeout_s))


class FailureBoard:
    """Where the agents of one run say that a child failed, and look for it.

    The store is PyTorch's ``TCPStore``, which authenticates nothing: a value that is not
    a rank of the run is ignored, so a stranger's write cannot blame a rank.

    Args:
        store: the agent store (a client or the server).
        world_size: the ranks of the run.
    """

    def __init__(self, store: dist.Store, world_size: int) -> None:
        self._store = store
        self._world_size = world_size
        self._lead_done = False

    def mark(self, rank: int) -> int:
        """Rank ``rank``'s child failed: claim the failure unless a rank did first (its child,
        or another agent); return the rank that failed first."""
        try:
            first = self._rank(self._store.compare_set(FAILED_KEY, "", str(rank)))
        except RuntimeError as exc:  # the store's host is gone: the others find out alike
            log.debug("could not mark rank %d failed in the store: %s", rank, exc)
            return rank
        return rank if first is None else first

    def failed(self) -> int | None:
        """The rank that failed first, or None; -1 when the store is gone before rank 0's
        child succeeded (its agent, rank 0's task, was lost)."""
        try:
            if not self._store.check([FAILED_KEY]):
                if not self._lead_done:
                    self._lead_done = self._store.check([_LEAD_DONE_KEY])
                return None
            return self._rank(self._store.get(FAILED_KEY))
        except RuntimeError:
            return None if self._lead_done else -1

    def lead_done(self) -> None:
        """Rank 0's child succeeded (called by its agent)."""
        self._store.set(_LEAD_DONE_KEY, "1")

    def _rank(self, value: bytes) -> int | None:
        try:
            rank = int(value.decode())
        except (UnicodeDecodeError, ValueError):
            return None
        return rank if 0 <= rank < self._world_size else None


@dataclass
class Outcome:
    """How one child ended.

    Attributes:
        rank: its rank.
        exit_code: its exit status (negative: the signal that ended it).
        stopped_for: the rank whose failure made the agent stop this child (None: it ended
            by itself); -1: the run's store was lost.
        stderr_tail: the last lines it wrote to stderr.
        seconds: how long it ran.
    """

    rank: int
    exit_code: int
    stopped_for: int | None = None
    stderr_tail: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.stopped_for is None


#: Called for every line a child writes: ``(rank, stream name, line)``.
LineSink = Callable[[int, str, str], None]


class Child:
    """One launched process, its output relayed line by line.

    Args:
        rank: its rank (names its lines).
        argv: the command.
        env: its whole environment.
        sink: called for each line it writes.
    """

    def __init__(self, rank: int, argv: Sequence[str], env: Mapping[str, str], sink: LineSink) -> None:
        self.rank = rank
        self.started = time.monotonic()
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.process = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: stopping it stops its children too
            preexec_fn=_die_with_parent,
        )
        assert self.process.stdout is not None and self.process.stderr is not None
        self._relays = [
            threading.Thread(
                target=self._relay,
                args=(stream, name, sink),
                name=f"sparkdl-relay-{rank}-{name}",
                daemon=True,
            )
            for stream, name in ((self.process.stdout, "stdout"), (self.process.stderr, "stderr"))
        ]
        for relay in self._relays:
            relay.start()

    def _relay(self, stream: IO[bytes], name: str, sink: LineSink) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")[:MAX_LINE_CHARS]
            if name == "stderr":
                self._tail.append(line)
            try:
                sink(self.rank, name, line)
            except Exception:  # a relay never stops reading: a full pipe would block the child
                pass
        stream.close()

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self, grace_s: float = TERMINATE_GRACE_S) -> None:
        """SIGTERM to its process group; SIGKILL after ``grace_s``."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.process.poll() is not None:
                return
            _signal_group(self.process.pid, sig)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                continue

    def outcome(self, stopped_for: int | None = None) -> Outcome:
        """Its outcome, once it exited: what is left of its process group (processes it
        started) is killed, and the relays drain what it wrote last."""
        try:
            code = self.process.wait(TERMINATE_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
        _signal_group(self.process.pid, signal.SIGKILL)
        for relay in self._relays:
            relay.join(2.0)
        return Outcome(self.rank, code, stopped_for, list(self._tail), time.monotonic() - self.started)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def supervise(
    children: Sequence[Child], board: FailureBoard, timeout_s: float | None = None
) -> list[Outcome]:
    """Wait for every child; on the first failure (here or, through ``board``, at another
    agent) stop the rest. Bounded by ``timeout_s`` when given (then every child still
    running is stopped, ``stopped_for = TIMED_OUT``).

    A child that failed after another rank's claim is recorded as stopped for that rank:
    its error is most likely the first one's echo (a collective cut short).

    Returns:
        one outcome per child, in the order given.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    outcomes: dict[int, Outcome] = {}
    running = {child.rank: child for child in children}
    while running:
        for rank, child in list(running.items()):
            if rank not in running:  # stopped with the others in this pass
                continue
            code = child.poll()
            if code is None:
                continue
            del running[rank]
            first = board.mark(rank) if code != 0 else None
            outcomes[rank] = child.outcome(stopped_for=None if first in (None, rank) else first)
            if first is not None:
                _stop_all(running, outcomes, first)
        if not running:
            break
        other = board.failed()
        if other is not None:
            _stop_all(running, outcomes, other)
        elif deadline is not None and time.monotonic() > deadline:
            _stop_all(running, outcomes, TIMED_OUT)
        else:
            time.sleep(POLL_S)
    return [outcomes[child.rank] for child in children]


#: ``Outcome.stopped_for`` of a child stopped at the run's time limit.
TIMED_OUT = -2


def _stop_all(running: dict[int, Child], outcomes: dict[int, Outcome], cause: int) -> None:
    """Stop every running child but rank ``cause``'s own (it claimed the failure and is
    exiting: stopping it could cut its error report short), and record their outcomes."""
    others = [child for rank, child in running.items() if rank != cause]
    stoppers = [threading.Thread(target=child.stop, daemon=True) for child in others]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join(2 * TERMINATE_GRACE_S + 5)
    for rank, child in list(running.items()):
        outcomes[rank] = child.outcome(stopped_for=None if rank == cause else cause)
        del running[rank]


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, resolved now: loading a library between fork and exec, while other
    threads of the agent run, could deadlock the child."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None


_PRCTL = _prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to SIGKILL the child when the agent that launched it dies."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def child_environment(slot: Slot, rendezvous: Rendezvous) -> dict[str, str]:
    """The agent's own environment with torchrun's for ``slot`` on top, and this process's
    ``sys.path`` as ``PYTHONPATH``, so the child imports what the agent imports."""
    env = dict(os.environ)
    env.update(torchrun_env(slot, rendezvous))
    paths = [p for p in sys.path if p]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env
