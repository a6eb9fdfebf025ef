"""``sparkdl.TorchDistributor``: PySpark's ``TorchDistributor``, drop-in, with sparkdl's
guarantees.

Code written for ``pyspark.ml.torch.distributor.TorchDistributor`` runs unchanged: the
same constructor (``num_processes``, ``local_mode``, ``use_gpu``), the same ``run(train_object,
*args, **kwargs)`` for a function or a script path with its arguments, the same
environment in the training processes (torchrun's: ``MASTER_ADDR``, ``MASTER_PORT``,
``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_*``, the
task's GPU as ``CUDA_VISIBLE_DEVICES``), and rank 0's return value back. What differs is
listed in docs/guide/own-loop.md; in short: no port race, every wait bounded, the first
failure stops every rank (noticed within 0.2 s) and comes back typed with its rank and its
traceback, a killed worker makes Spark re-run the stage, the processes' output reaches the
driver, and a returned state dict travels without pickle or the JVM.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from sparkdl.config import UseGpu
from sparkdl.errors import ClusterConfigError, ConfigError
from sparkdl.launch.user_code import showing_worker_output
from sparkdl.services.progress.board import ProgressBoard
from sparkdl.spark.cluster import is_connect, is_local_mode
from sparkdl.spark.distributor_task import launch_partition
from sparkdl.spark.returned_rows import RETURNED_SCHEMA, rank0_value, unpickled
from sparkdl.spark.shipping import pickled_call
from sparkdl.spark.stage import barrier_stage, stage_site
from sparkdl.spark.watch import MARGIN_S
from sparkdl.worker.distributor_agent import LaunchSpec, Program, run_local

log = logging.getLogger(__name__)


class TorchDistributor:
    """Runs a PyTorch training function or script on Spark, as torchrun would.

    Args:
        num_processes: the training processes (one barrier task each, or, in local mode,
            processes on the driver).
        local_mode: run every process on the driver (as PySpark's default), else one per
            barrier task on the executors.
        use_gpu: give each process a GPU (the task's, from Spark's resource scheduling; in
            local mode the driver's); else ``CUDA_VISIBLE_DEVICES`` is empty.
        timeout_s: stop the run after this long (sparkdl only; None: no limit).
        rendezvous_timeout_s: how long the processes may take to meet, and rank 0's task
            waits for the others at the end (sparkdl only).
        spark: the session (default: the active one).

    Raises:
        ConfigError: a setting out of range.
        RuntimeError: no active SparkSession (as PySpark's).
    """

    def __init__(
        self,
        num_processes: int = 1,
        local_mode: bool = True,
        use_gpu: bool = True,
        *,
        timeout_s: float | None = None,
        rendezvous_timeout_s: float = 300.0,
        spark: Any = None,
    ) -> None:
        if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
            raise ConfigError(f"num_processes must be a positive int, got {num_processes!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
        if not rendezvous_timeout_s > 0:
            raise ConfigError(f"rendezvous_timeout_s must be positive, got {rendezvous_timeout_s!r}")
        if spark is None:
            from pyspark.sql import SparkSession

            spark = SparkSession.active()  # RuntimeError without one, as PySpark's
        self.num_processes = num_processes
        self.local_mode = local_mode
        self.use_gpu = use_gpu
        self.timeout_s = timeout_s
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.spark = spark

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Run ``train_object`` in every process; return rank 0's return value.

        Args:
            train_object: a function (called with ``*args, **kwargs``), or the path of a
                Python script (run with ``args`` as its command-line arguments; no kwargs).

        Returns:
            what the function returned on rank 0 (None for a script). A dict of tensors
            comes back through the driver's weights server (``weights_only``), anything else
            cloudpickled, as PySpark's does.

        Raises:
            TrainFunctionError: the code raised (its type, message and traceback, the rank)
                or a script exited non-zero (its last lines of stderr).
            RunTimeout: ``timeout_s`` ran out.
            ConfigError: the function cannot be pickled (named), kwargs given to a script.
            ClusterConfigError: not enough slots or GPUs for ``num_processes``.
        """
        program = make_program(train_object, args, kwargs)
        with showing_worker_output():
            if self.local_mode:
                return self._run_local(program)
            return self._run_distributed(program)

    def _spec(self, program: Program, **fields: Any) -> LaunchSpec:
        return LaunchSpec(
            program,
            self.num_processes,
            self.use_gpu,
            self.timeout_s,
            self.rendezvous_timeout_s,
            **fields,
        )

    def _run_local(self, program: Program) -> Any:
        gpus = local_gpus(self.spark, self.num_processes) if self.use_gpu else ()
        log.info("TorchDistributor: %d processes on the driver", self.num_processes)
        returned = run_local(self._spec(program), gpus)
        if returned.state_dict is not None:
            return returned.state_dict
        return unpickled(returned.pickled)

    def _run_distributed(self, program: Program) -> Any:
        spark, n, rendezvous_s = self.spark, self.num_processes, self.rendezvous_timeout_s
        use_gpu = UseGpu.YES if self.use_gpu else UseGpu.NO
        site = stage_site(spark, n, use_gpu=use_gpu, wait_s=60.0, collective_s=rendezvous_s)
        board = ProgressBoard(n, 1, show=False)
        with barrier_stage(
            site,
            collective_s=rendezvous_s,
            bound_s=rendezvous_s + MARGIN_S,
            encrypt=False,
            board=board,
            interval_s=1.0,
        ) as stage:
            spec = self._spec(
                program,
                progress=stage.progress_endpoint,
                weights=stage.weights,
                meeting=stage.meeting,
                tasks_print_on_driver=tasks_print_on_driver(spark),
            )
            task = functools.partial(launch_partition, spec)
            description = f"sparkdl TorchDistributor: {program.name} on {n} processes"
            rows = stage.run(spark.range(0, n, 1, n), task, RETURNED_SCHEMA, description)
            return rank0_value(rows, stage.uploaded())
        raise AssertionError("unreachable")  # pragma: no cover


def make_program(
    train_object: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Program:
    """What every process runs, checked on the driver.

    Raises:
        ConfigError: kwargs for a script; a function that cannot be pickled (named,
            with the reason).
    """
    if isinstance(train_object, (str, os.PathLike)):
        path = os.fspath(train_object)
        if kwargs:
            raise ConfigError(
                f"TorchDistributor.run({path!r}) got keyword arguments {sorted(kwargs)}; a script takes "
                "command-line arguments only: pass them as strings, e.g. run(path, '--lr=0.1')"
            )
        return Program(script=path, arguments=tuple(str(a) for a in args), name=path)
    if not callable(train_object):
        raise ConfigError(
            f"TorchDistributor.run takes a function or a script path, got {type(train_object).__name__}"
        )
    name, payload = pickled_call(train_object, args, kwargs, "TorchDistributor.run")
    return Program(function=payload, name=name)


def tasks_print_on_driver(spark: Any) -> bool:
    """Whether the tasks' own stdout and stderr reach this driver's: under a ``local[N]``
    master the executor is the driver's JVM, which writes its Python workers' output on its
    stderr (a cluster's, and ``local-cluster``'s, executors keep theirs in their own logs)."""
    return not is_connect(spark) and is_local_mode(spark.sparkContext.master)


def local_gpus(spark: Any, num_processes: int) -> tuple[str, ...]:
    """The GPUs the processes of local mode share: the driver's from Spark's resources,
    else those CUDA shows this process.

    Raises:
        ClusterConfigError: fewer GPUs than processes.
    """
    addresses: list[str] = []
    if not is_connect(spark):
        resources = spark.sparkContext.resources
        if "gpu" in resources:
            addresses = list(resources["gpu"].addresses)
    if not addresses:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        count = torch.cuda.device_count()
        addresses = visible.split(",")[:count] if visible else [str(i) for i in range(count)]
    if len(addresses) < num_processes:
        raise ClusterConfigError(
            f"TorchDistributor(use_gpu=True, local_mode=True) runs {num_processes} processes, one GPU each, "
            f"but the driver has {len(addresses)} GPU(s) ({addresses}); lower num_processes, give the driver "
            "GPUs (spark.driver.resource.gpu.amount), or set use_gpu=False"
        )
    return tuple(addresses[:num_processes])
