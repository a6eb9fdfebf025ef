"""Which device a task trains on, decided from the GPUs Spark assigned to it.

Pure: the caller passes in what Spark and CUDA report, so every rule is unit-tested
without either.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from sparkdl.config import Backend, UseGpu
from sparkdl.errors import ClusterConfigError

log = logging.getLogger(__name__)


def choose_device(
    use_gpu: UseGpu, gpu_addresses: Sequence[str], cuda_device_count: int, rank: int
) -> torch.device:
    """The task's device: ``cuda:<first assigned address>`` or ``cpu``.

    Args:
        use_gpu: the ``runtime.use_gpu`` setting.
        gpu_addresses: ``TaskContext.resources()["gpu"].addresses`` (empty if none).
        cuda_device_count: ``torch.cuda.device_count()`` on the executor.
        rank: this worker's rank, named in errors.

    Raises:
        ClusterConfigError: GPUs were required but the task got none, or Spark
            assigned an address that this process cannot see.
    """
    if use_gpu is UseGpu.NO:
        return torch.device("cpu")
    if not gpu_addresses:
        if use_gpu is UseGpu.YES:
            raise ClusterConfigError(
                f"rank {rank}: use_gpu = true but Spark assigned this task no GPU; give the "
                "executors GPUs (spark.executor.resource.gpu.amount with a discovery script; fit "
                "then asks one per training task), or set use_gpu = 'auto' to train on CPU"
            )
        return torch.device("cpu")
    if cuda_device_count == 0 and use_gpu is UseGpu.AUTO:
        log.warning(
            "rank %d: Spark assigned GPU %s but this process sees no CUDA device (a CPU build of "
            "torch, or no driver); training on CPU. Install torch with CUDA on the executors",
            rank,
            gpu_addresses[0],
        )
        return torch.device("cpu")
    index = int(gpu_addresses[0])
    if index >= cuda_device_count:
        raise ClusterConfigError(
            f"rank {rank}: Spark assigned GPU address {gpu_addresses[0]!r} but this process sees "
            f"{cuda_device_count} CUDA device(s); check CUDA_VISIBLE_DEVICES and the GPU "
            "discovery script of the executors"
        )
    return torch.device("cuda", index)


def choose_backend(backend: Backend, device: torch.device) -> str:
    """``auto`` picks NCCL for CUDA devices and gloo for CPU."""
    if backend is Backend.AUTO:
        return "nccl" if device.type == "cuda" else "gloo"
    if backend is Backend.NCCL and device.type != "cuda":
        raise ClusterConfigError(
            "runtime.backend = 'nccl' but this task trains on CPU; set backend = 'auto' or "
            "'gloo', or give the tasks GPUs (spark.task.resource.gpu.amount)"
        )
    return backend.value
