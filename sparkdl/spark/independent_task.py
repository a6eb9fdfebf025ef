"""The executor's side of the asynchronous parameter server in ordinary tasks
(``parameter_server.ps_barrier = false``): one task per partition, on its own.

Each task trains its partition as a world of one (its process group, if any, has no peer:
no collective crosses between workers) and pushes to the driver's server as its partition,
under its Spark task attempt (:class:`~sparkdl.comm.ps_endpoint.PsEndpoint`'s ``partition``
and ``task_attempt``). The server answers its HELLO with the partition's rows whose pushes
it applied; a retried task skips those and trains the rest. Any error fails the task, with
the error's record embedded (as a barrier task's), and Spark retries it alone
(``spark.task.maxFailures``); the other tasks never wait.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator

import pyarrow as pa

from sparkdl.errors import ErrorRecord, WorkerFailed
from sparkdl.spark.fit_task import result_batch
from sparkdl.worker.assembly import TrainSpec, run_worker
from sparkdl.worker.builder import Placement

#: The address a task's group of one binds: it never talks to another process.
_ALONE = "127.0.0.1"


def train_alone(spec: TrainSpec, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The ``mapInArrow`` function of an independent task: train this partition against the
    driver's server; the result row of the partition (its weights only for partition 0).

    Raises:
        WorkerFailed: any error (Spark retries the task alone).
    """
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        raise RuntimeError("train_alone runs inside a Spark task (mapInArrow), not on the driver")
    partition, attempt = ctx.partitionId(), ctx.attemptNumber()
    if spec.ps is None:
        raise WorkerFailed(
            ErrorRecord.of(
                RuntimeError("an independent task needs the driver's parameter server; fit starts one"),
                rank=partition,
                partition=partition,
                attempt=attempt,
            )
        )
    runtime = spec.config.runtime
    placement = Placement(
        rank=0,
        world_size=1,
        host=_ALONE,
        torch_threads=runtime.torch_threads or int(ctx.cpus() or 1),
        task_attempt=ctx.taskAttemptId(),
    )
    # fenced by its task id: unique in the application and larger for every retry, where the
    # attempt number starts again at 0 when Spark resubmits the stage
    own = dataclasses.replace(
        spec, ps=dataclasses.replace(spec.ps, partition=partition, task_attempt=ctx.taskAttemptId())
    )
    try:
        result = run_worker(own, batches, placement, lambda said: [said])
    except Exception as exc:
        raise WorkerFailed(ErrorRecord.of(exc, rank=partition, partition=partition, attempt=attempt)) from exc
    result.rank = partition
    result.device["host"] = executor_address(spec.ps.host)  # not the group of one's loopback
    if partition != 0:  # one copy of the buffers and frozen weights is enough
        result.state = b""
    yield result_batch(result)


def executor_address(driver_host: str) -> str:
    """The address this executor reaches ``driver_host`` from: the one the cluster knows it by
    (a datagram socket's ``connect`` picks the route and sends nothing). Loopback where no
    route is found."""
    try:
        family, kind, proto, _, target = socket.getaddrinfo(driver_host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(target)
            return str(probe.getsockname()[0])
    except OSError:
        return _ALONE
