"""The agent of :class:`sparkdl.TorchDistributor`: what one barrier task (or, in local
mode, the driver) does to run the user's function or script as torchrun would.

One agent per barrier task, one child process per agent (``local_mode = False``), or one
agent on the driver for every child (``local_mode = True``). An agent:

1. meets the others (rank 0's agent hosts the store first: :func:`~sparkdl.comm.rendezvous.serve_store`),
   and probes every peer's address, so a rank that cannot reach another fails in seconds;
2. launches its child with torchrun's environment and relays its output (each line shown
   once on the driver: see :func:`_relay_to`);
3. supervises it: the first child to fail stops every other (noticed within 0.2 s);
4. brings back rank 0's return value, or the failure as an error record.

What a failure means for Spark. An exception the user's code raised, or a script's
non-zero exit, is the code's own: every agent ends its task normally with the error in
its result row (re-running would fail alike). A child killed by a signal, or a lost
agent, fails the task, so Spark re-runs the barrier stage.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparkdl.comm.rendezvous import AllGather, meet_peers, serve_store
from sparkdl.errors import (
    PeerStopped,
    RunTimeout,
    SparkDLError,
    TrainFunctionError,
    WeightTransferError,
    agreed,
)
from sparkdl.services.meeting.endpoint import MeetingPoint
from sparkdl.services.progress.channel import ProgressEndpoint, ProgressReporter, reporting_to_driver
from sparkdl.services.weights.endpoint import WeightsEndpoint
from sparkdl.worker import child as child_files
from sparkdl.worker.builder import HEARTBEAT_S, Placement
from sparkdl.worker.launcher import (
    TIMED_OUT,
    Child,
    FailureBoard,
    LineSink,
    Outcome,
    Rendezvous,
    Slot,
    child_environment,
    join_store,
    supervise,
)
from sparkdl.worker.returned import Returned, returned_state

log = logging.getLogger(__name__)

_DONE_KEY = "sparkdl/launch/done"


@dataclass(frozen=True)
class Program:
    """What each child runs: a cloudpickled ``(function, args, kwargs)``, or a script.

    Attributes:
        function: the pickled call (b"" for a script).
        script: the script's path (for a function: "").
        arguments: the script's command-line arguments.
        name: how errors name it (the function's qualified name, or the path).
    """

    function: bytes = b""
    script: str = ""
    arguments: tuple[str, ...] = ()
    name: str = ""

    def argv(self, directory: str) -> list[str]:
        """The child's command line (``directory`` holds a function's files)."""
        if self.script:
            return [sys.executable, self.script, *self.arguments]
        return [sys.executable, "-m", "sparkdl.worker.child", directory]


@dataclass(frozen=True)
class LaunchSpec:
    """One run, as every agent needs it (shipped to the tasks with the stage).

    Attributes:
        program: what the children run.
        num_processes: the children of the run.
        use_gpu: give each child the GPUs of its task (else ``CUDA_VISIBLE_DEVICES=""``).
        timeout_s: the run's time limit (None: none).
        rendezvous_timeout_s: how long the agents wait for each other, and the store waits.
        progress: the driver's channel for output and heartbeats (None: none).
        weights: where rank 0 sends a returned state dict (None: in the result rows).
        meeting: the driver's meeting point (None: Spark's allGather).
        tasks_print_on_driver: the tasks' own stdout and stderr are the driver's (a
            ``local[N]`` master: the executor is the driver's JVM, which writes its Python
            workers' output on its stderr), so a line the progress channel carried is not
            written there again.
    """

    program: Program
    num_processes: int
    use_gpu: bool = False
    timeout_s: float | None = None
    rendezvous_timeout_s: float = 300.0
    progress: ProgressEndpoint | None = None
    weights: WeightsEndpoint | None = None
    meeting: MeetingPoint | None = None
    tasks_print_on_driver: bool = False


# --------------------------------------------------------------------------- one task's agent


def run_agent(spec: LaunchSpec, place: Placement, all_gather: AllGather) -> Returned:
    """Meet the other agents, run this task's child, and return rank 0's value.

    Raises:
        TrainFunctionError: the user's code failed (here, or on another rank: then
            :class:`~sparkdl.errors.PeerStopped`); marked agreed, so Spark does not re-run it.
        RendezvousError, RendezvousTimeout: the agents could not meet or reach each other.
        SparkDLError: the child was killed, or rank 0's agent was lost (not agreed: re-run).
    """
    with contextlib.ExitStack() as stack:
        hosted, rendezvous = _meet(spec, place, all_gather, stack)
        store = (
            hosted
            if hosted is not None
            else join_store(rendezvous.host, rendezvous.port, spec.rendezvous_timeout_s)
        )
        reporter = stack.enter_context(
            reporting_to_driver(spec.progress, place.rank, rendezvous.attempt, heartbeat_s=HEARTBEAT_S)
        )
        directory = stack.enter_context(_workdir())
        gpus = place.gpu_addresses if spec.use_gpu else ()
        slot = Slot(
            place.rank, place.world_size, 0, 1, place.rank, place.world_size, gpus, place.torch_threads
        )
        env = child_environment(slot, rendezvous)
        sink = _relay_to(reporter, spec.tasks_print_on_driver)
        child = _launch(spec.program, place.rank, env, directory, sink)
        board = FailureBoard(store, place.world_size)
        (outcome,) = supervise([child], board, spec.timeout_s)
        _say_done(store)
        if hosted is not None:  # the others may still use the store, or must see a failure mark
            if outcome.ok:
                board.lead_done()
            _await_everyone(store, place.world_size, spec.rendezvous_timeout_s)
        raise_failure(outcome, spec, directory)
        if place.rank != 0 or spec.program.script:
            return Returned()
        try:
            return _returned(directory, spec.weights)
        except WeightTransferError as exc:  # training is done: a re-run would not bring it back
            raise agreed(exc) from exc
    raise AssertionError("unreachable")  # pragma: no cover


def _meet(
    spec: LaunchSpec, place: Placement, all_gather: AllGather, stack: contextlib.ExitStack
) -> tuple[dist.TCPStore | None, Rendezvous]:
    """Rank 0 hosts the run's store; every agent learns its address, probes every other
    agent's host, and agrees on the stage attempt and the run's id."""
    hosted = None
    said: dict[str, Any] = {}
    if place.rank == 0:
        hosted, port = serve_store(place.host, spec.rendezvous_timeout_s)
        said.update(store=[place.host, port], run_id=secrets.token_hex(8))
    messages, attempt, probe = meet_peers(
        place.rank,
        place.world_size,
        place.host,
        all_gather,
        place.task_attempt,
        said,
        spec.rendezvous_timeout_s,
    )
    stack.enter_context(probe)  # open for the agent's life: a slower agent may still probe it
    lead = messages[0]
    host, port = lead["store"]
    return hosted, Rendezvous(host, int(port), lead["run_id"], attempt)


def _say_done(store: Any) -> None:
    """This agent's child has ended (and, after a failure, its mark is in the store)."""
    try:
        store.add(_DONE_KEY, 1)
    except RuntimeError as exc:  # rank 0's task is gone: nothing waits for this any more
        log.debug("could not tell rank 0 that this child ended: %s", exc)


def _await_everyone(store: Any, world_size: int, timeout_s: float) -> None:
    """Rank 0's agent holds the run's store until every agent's child has ended: the
    others may still use it, and after a failure they must read its mark there (a store
    that vanished would look like a lost rank 0, which Spark re-runs). Bounded by
    ``timeout_s`` after rank 0's own child ended."""
    deadline = time.monotonic() + timeout_s
    while (done := int(store.add(_DONE_KEY, 0))) < world_size:
        if time.monotonic() > deadline:
            log.warning(
                "rank 0's child ended %.0fs ago but %d other rank(s) still run; rank 0's task stops "
                "holding the run's store (raise rendezvous_timeout_s if ranks end far apart)",
                timeout_s,
                world_size - done,
            )
            return
        time.sleep(0.1)


@contextlib.contextmanager
def _workdir() -> Iterator[str]:
    """A private directory for the child's files, on Spark's local disk where it has one."""
    root = os.environ.get("SPARK_LOCAL_DIRS", "").split(",")[0] or None
    directory = tempfile.mkdtemp(prefix="sparkdl-run-", dir=root)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _launch(program: Program, rank: int, env: dict[str, str], directory: str, sink: LineSink) -> Child:
    if program.function:
        with open(os.path.join(directory, child_files.FUNCTION_FILE), "wb") as out:
            out.write(program.function)
    return Child(rank, program.argv(directory), env, sink)


def _relay_to(reporter: ProgressReporter | None, prints_on_driver: bool) -> LineSink:
    """Each line a child writes: to the driver, where its progress channel listens (shown
    there as ``[rank N] line``), and into this process's own stream, the executor's log.
    Not into that stream when it is the driver's own (``prints_on_driver``: a ``local[N]``
    master) and the channel carried the line: the driver shows each line once."""

    def sink(rank: int, stream: str, line: str) -> None:
        sent = reporter is not None and reporter.log(logging.INFO, line)
        if not (sent and prints_on_driver):
            print(line, file=sys.stderr if stream == "stderr" else sys.stdout, flush=True)

    return sink


def _returned(directory: str, weights: WeightsEndpoint | None) -> Returned:
    """Rank 0's return value as its child left it (see :func:`returned_state`); anything
    but a state dict comes back pickled."""
    tensors = os.path.join(directory, child_files.TENSORS_FILE)
    if os.path.exists(tensors):
        return returned_state(torch.load(tensors, weights_only=True), weights)
    pickled = os.path.join(directory, child_files.PICKLE_FILE)
    if os.path.exists(pickled):
        with open(pickled, "rb") as source:
            return Returned(pickled=source.read())
    return Returned()


# --------------------------------------------------------------------------- outcomes as errors


def raise_failure(outcome: Outcome, spec: LaunchSpec, directory: str) -> None:
    """Raise the error ``outcome`` stands for (nothing when the child succeeded)."""
    error = failure(outcome, spec, directory)
    if error is not None:
        error.rank = outcome.rank
        raise error


def failure(outcome: Outcome, spec: LaunchSpec, directory: str) -> SparkDLError | None:
    """The error of a child's ``outcome`` (pure but for reading its error file), or None.

    Agreed (no re-run): the code's own exception or exit status, a peer's failure, the
    time limit. Not agreed (Spark re-runs the stage): a signal, a lost store."""
    name, rank = spec.program.name, outcome.rank
    if outcome.stopped_for == TIMED_OUT:
        return agreed(
            RunTimeout(
                f"rank {rank}: {name} ran past timeout_s = {spec.timeout_s:.0f}s and was stopped; "
                "raise timeout_s, or leave it unset for no limit",
                setting="timeout_s",
                limit_s=spec.timeout_s,
            )
        )
    if outcome.stopped_for == -1:
        return SparkDLError(
            f"rank {rank}: the run's store on rank 0's task was lost (its executor failed?); "
            "the child was stopped so that Spark re-runs the stage"
        )
    if outcome.stopped_for is not None:
        return agreed(PeerStopped(f"rank {rank} stopped because rank {outcome.stopped_for} failed"))
    if outcome.exit_code == 0:
        return None
    tail = "\n".join(outcome.stderr_tail)
    if outcome.exit_code < 0:
        return SparkDLError(
            f"rank {rank}: {name} was killed by signal {-outcome.exit_code} after {outcome.seconds:.1f}s "
            f"(out of memory? the executor's log has more); Spark re-runs the stage. Its last lines:\n{tail}"
        )
    recorded = _error_file(directory)
    if recorded is not None:
        return agreed(
            TrainFunctionError(
                f"rank {rank}: {name} raised {recorded['python_type']}: {recorded['message']}\n"
                f"{recorded['traceback']}",
                recorded["python_type"],
                outcome.exit_code,
                tail,
            )
        )
    return agreed(
        TrainFunctionError(
            f"rank {rank}: {name} exited with status {outcome.exit_code}; "
            f"the last lines of its stderr:\n{tail}",
            "",
            outcome.exit_code,
            tail,
        )
    )


def _error_file(directory: str) -> dict[str, str] | None:
    path = os.path.join(directory, child_files.ERROR_FILE)
    try:
        with open(path, encoding="utf-8") as source:
            return dict(json.load(source))
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- local mode


def run_local(spec: LaunchSpec, gpus: Sequence[str] | None, host: str = "127.0.0.1") -> Returned:
    """Every child on this machine (PySpark's ``local_mode = True``): this process is the
    agent of all of them, as torchrun's ``--standalone`` is.

    Args:
        spec: the run.
        gpus: the GPUs every child sees (``LOCAL_RANK`` picks one), ``()`` for none.
        host: where the store listens.

    Raises:
        TrainFunctionError, RunTimeout, SparkDLError: the first child's failure.
    """
    n = spec.num_processes
    hosted, port = serve_store(host, spec.rendezvous_timeout_s)
    rendezvous = Rendezvous(host, port, secrets.token_hex(8))
    threads = max(1, (os.cpu_count() or 1) // n)
    with contextlib.ExitStack() as stack:
        directories = [stack.enter_context(_workdir()) for _ in range(n)]
        children: list[Child] = []
        try:
            for rank in range(n):
                slot = Slot(rank, n, rank, n, 0, 1, tuple(gpus) if gpus is not None else None, threads)
                env = child_environment(slot, rendezvous)
                children.append(_launch(spec.program, rank, env, directories[rank], _print_prefixed))
        except BaseException:
            for started in children:
                started.stop()
            raise
        outcomes = supervise(children, FailureBoard(hosted, n), spec.timeout_s)
        errors = [failure(o, spec, directories[o.rank]) for o in outcomes]
        first = _first_failure(outcomes, errors)
        if first is not None:
            raise first
        return Returned() if spec.program.script else _returned(directories[0], None)
    raise AssertionError("unreachable")  # pragma: no cover


def _first_failure(outcomes: list[Outcome], errors: list[SparkDLError | None]) -> SparkDLError | None:
    """The error of the rank that failed first (a stopped peer's only when no other)."""
    failed = [(o, e) for o, e in zip(outcomes, errors, strict=True) if e is not None]
    if not failed:
        return None
    failed.sort(key=lambda pair: (isinstance(pair[1], PeerStopped), pair[0].seconds))
    outcome, error = failed[0]
    error.rank = outcome.rank
    return error


def _print_prefixed(rank: int, stream: str, line: str) -> None:
    print(f"[rank {rank}] {line}", file=sys.stderr if stream == "stderr" else sys.stdout, flush=True)
