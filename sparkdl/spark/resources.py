"""GPU scheduling of the training stage: its own resource profile (stage-level scheduling).

A cluster whose executors have GPUs (``spark.executor.resource.gpu.amount`` with a
discovery script) need not set ``spark.task.resource.gpu.amount`` for the whole
application: the ETL stages before ``fit`` then run on all cores without holding a
GPU, and only the barrier training stage asks for one GPU per task through a task
resource profile (Spark >= 3.4 schedules those on standalone, YARN and Kubernetes
with dynamic allocation off, which barrier mode needs anyway).

``decide_gpu_request`` is pure (tested without Spark); ``training_profile`` builds
the profile from a session's settings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sparkdl.config import UseGpu
from sparkdl.errors import ClusterConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuRequest:
    """What the training stage asks Spark for, per task."""

    gpus: float  # 0: no GPU request of our own
    cpus: int
    reason: str


def decide_gpu_request(
    use_gpu: UseGpu, executor_gpus: float, task_gpus: float, task_cpus: int, master: str
) -> GpuRequest:
    """Decide the training stage's per-task request from the session's settings.

    Args:
        use_gpu: ``runtime.use_gpu``.
        executor_gpus: ``spark.executor.resource.gpu.amount`` (0 when unset).
        task_gpus: ``spark.task.resource.gpu.amount`` (0 when unset): set, every stage
            of the application already holds GPUs and no profile is needed.
        task_cpus: ``spark.task.cpus``.
        master: the master URL (named in errors).

    Raises:
        ClusterConfigError: ``use_gpu = true`` on executors that have no GPUs.
    """
    if use_gpu is UseGpu.NO:
        return GpuRequest(0, task_cpus, "use_gpu = false")
    if task_gpus > 0:
        return GpuRequest(0, task_cpus, f"spark.task.resource.gpu.amount = {task_gpus:g} for every stage")
    if executor_gpus <= 0:
        if use_gpu is UseGpu.YES:
            raise ClusterConfigError(
                f"use_gpu = true but the executors of {master} have no GPUs: set "
                "spark.executor.resource.gpu.amount (and spark.executor.resource.gpu.discoveryScript, "
                "or the worker's spark.worker.resource.gpu.*) when the session starts, or set "
                "use_gpu = 'auto' to train on CPU"
            )
        return GpuRequest(0, task_cpus, "the executors have no GPUs")
    return GpuRequest(1, task_cpus, f"executors have {executor_gpus:g} GPU(s): one per training task")


def training_profile(spark: Any, use_gpu: UseGpu) -> Any | None:
    """The training stage's ResourceProfile, or None to run it with the default one."""
    conf = spark.sparkContext.getConf()
    request = decide_gpu_request(
        use_gpu,
        float(conf.get("spark.executor.resource.gpu.amount", "0")),
        float(conf.get("spark.task.resource.gpu.amount", "0")),
        int(conf.get("spark.task.cpus", "1")),
        spark.sparkContext.master,
    )
    if not request.gpus:
        log.debug("training stage uses the default resource profile: %s", request.reason)
        return None
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    tasks = TaskResourceRequests().cpus(request.cpus).resource("gpu", request.gpus)
    profile = ResourceProfileBuilder().require(tasks).build
    log.info("training stage resource profile %s: %s", profile.id, request.reason)
    return profile
