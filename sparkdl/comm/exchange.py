"""One exchange per worker: the door every strategy's sums and broadcasts go through.

How bytes move between the workers is decided once, when the worker is assembled
(:func:`sparkdl.comm.forming.form_exchange`), from the settings, the device and where the workers run:

- :class:`FlatExchange`: the process group over every worker (gloo or NCCL), with the
  run's compression (``runtime.compression``): DDP's hooks for gradients (PyTorch's fp16
  and PowerSGD, ours for bf16, 1bit and topk), error-feedback codecs for averages.
- :class:`HostMemoryExchange`: every worker shares one host and the strategy's exchange
  is a plain sum (``runtime.shared_memory``, CPUs, no compression): a shared-memory
  segment of the host's workers instead of gloo's loopback TCP.
- :class:`HierarchicalExchange`: ``runtime.hierarchy`` found several hosts with several
  workers each: sum within the host (its shared memory where it can), all-reduce among
  the hosts' leaders, broadcast back to the host.

A strategy calls the same methods whatever was chosen, and never asks which; adding a
transport touches this package alone. Each exchange counts what this worker sends
(:class:`Traffic`); control messages (a few numbers a step) are not counted.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from sparkdl.comm.compression.codecs import ErrorFeedback, OneBit, TopK, codec_for
from sparkdl.comm.compression.collectives import CompressedAllReduce, CompressedAverage, bf16_allreduce_hook
from sparkdl.comm.compression.powersgd import cpu_powersgd_hook, powersgd_bytes
from sparkdl.comm.hierarchy import HierarchicalAllReduce, HostGroups, hierarchical_bytes
from sparkdl.comm.shared_memory import SharedMemoryGroup, shared_memory_hook
from sparkdl.comm.traffic import ring_allreduce_bytes
from sparkdl.config import Compression, RuntimeConfig
from sparkdl.errors import ClusterConfigError

log = logging.getLogger(__name__)

#: Tensors by name (the name keys a compressed average's reference and residual).
NamedBucket = Sequence[tuple[str, torch.Tensor]]


@dataclass
class Traffic:
    """What this worker sent since the counters were last taken.

    Attributes:
        bytes_sent: onto any link or into shared memory, by every collective but control messages.
        bytes_across_hosts: the part of it that left this worker's host (a hierarchy's leaders,
            a flat gloo ring's rank whose successor runs on another host).
    """

    bytes_sent: int = 0
    bytes_across_hosts: int = 0


def buckets(named: NamedBucket, cap_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of the same dtype and device, each under ``cap_bytes``."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        first = bucket[0][1] if bucket else tensor
        compatible = tensor.dtype == first.dtype and tensor.device == first.device
        if bucket and (size + nbytes > cap_bytes or not compatible):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class PendingSum:
    """A weighted sum on its way (:meth:`Exchange.start_weighted_sum`): :meth:`wait` gives it,
    the buckets' tensors flat, in order, as float32."""

    def __init__(self, flats: list[torch.Tensor], works: Sequence[dist.Work] = ()) -> None:
        self._flats = flats
        self._works = list(works)

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works = []
        return torch.cat(self._flats) if len(self._flats) != 1 else self._flats[0]


class Exchange(abc.ABC):
    """The sums and broadcasts of one worker with the others; chosen by
    :func:`sparkdl.comm.forming.form_exchange`.

    Args:
        world_size: the workers.
        control: the gloo group for small CPU messages (None: the default group).
    """

    #: How this worker exchanges, as fit reports it ("gloo", "nccl", "shared_memory", ...).
    name: str

    def __init__(self, world_size: int, control: dist.ProcessGroup | None = None) -> None:
        self.world_size = world_size
        self.control = control
        self.traffic = Traffic()
        self._gradient_step_bytes = 0

    # -- control messages: a few numbers, not counted ------------------------------------

    def sum_control_(self, tensor: torch.Tensor) -> None:
        """Sum a small CPU tensor over every worker, in place (step planning, row counts)."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.control)

    def sum_(self, tensor: torch.Tensor) -> None:
        """Sum a small tensor on the worker's device over every worker, in place (a round's
        message before an average)."""
        if self.world_size > 1:
            dist.all_reduce(tensor)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Replace ``tensor`` by rank ``src``'s on every worker (the starting weights)."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=src)

    # -- payloads: counted ----------------------------------------------------------------

    def remember(self, named: NamedBucket) -> None:  # noqa: B027 - only a compressed average keeps references
        """The tensors every worker now holds alike (the weights after the starting broadcast):
        what a compressed average measures its first change from."""

    def weighted_sum_(
        self, buckets: Sequence[NamedBucket], own_weight: float, lossless: bool = False
    ) -> None:
        """Replace every tensor of ``buckets`` by ``sum_i own_weight_i * t_i`` over the workers
        (a weighted average when the weights add up to 1), bucket by bucket. ``lossless``:
        never through a lossy codec (state that must stay positive, such as Adam's second
        moments: a sum of decoded changes can make it negative)."""
        flats = [
            torch.cat([t.detach().reshape(-1) for _, t in bucket]).mul_(own_weight) for bucket in buckets
        ]
        self._sum_flats_(flats)
        with torch.no_grad():
            for bucket, flat in zip(buckets, flats, strict=True):
                offset = 0
                for _, tensor in bucket:
                    tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()
        payload = sum(flat.numel() * flat.element_size() for flat in flats)
        self.traffic.bytes_sent += self.sum_bytes(payload)

    def start_weighted_sum(self, buckets: Sequence[NamedBucket], own_weight: float) -> PendingSum:
        """Begin :meth:`weighted_sum_` of float32 ``buckets`` (tensors the caller gives up to it:
        copies) and return the handle to wait on; the caller goes on training meanwhile. Here it
        is made at once; a plain process group overlaps it (:class:`FlatExchange`)."""
        self.weighted_sum_(buckets, own_weight)
        return PendingSum([torch.cat([t.reshape(-1) for _, t in bucket]) for bucket in buckets])

    def gather_control(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every worker's small CPU ``tensor``, stacked by rank (a few counts; not counted)."""
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.control)
        return torch.stack(parts)

    def gather_(self, flat: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Every worker's 1-D ``flat``, by rank; ``lengths`` are their sizes, known to every
        worker (through :meth:`gather_control`). One all-gather of the longest, the others
        padded; counted as a ring's: this worker sends each of the others' pieces on once."""
        if self.world_size == 1:
            return [flat]
        longest = max(lengths)
        padded = torch.zeros(longest, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        self.traffic.bytes_sent += (self.world_size - 1) * padded.nbytes
        return [part[:length] for part, length in zip(parts, lengths, strict=True)]

    def attach_gradient_hook(self, ddp: nn.parallel.DistributedDataParallel, grad_bytes: int) -> None:
        """Make ``ddp`` average its gradient buckets through this exchange; ``grad_bytes`` is
        what one step's gradients weigh. Count each step with :meth:`count_gradient_step`."""
        self._gradient_step_bytes = self._register_hook(ddp, grad_bytes)

    def count_gradient_step(self) -> None:
        """One step's gradients went through the hook: add what they sent to :attr:`traffic`."""
        self.traffic.bytes_sent += self._gradient_step_bytes

    def take_hook_failure(self) -> BaseException | None:
        """The error a communication hook's future failed with since the last call, if any: DDP
        re-raises it as a RuntimeError with its text only, so the caller raises this instead."""
        return None

    def take_traffic(self) -> Traffic:
        """The counters since the last call; they start afresh."""
        taken, self.traffic = self.traffic, Traffic()
        return taken

    @abc.abstractmethod
    def sum_bytes(self, payload: int) -> int:
        """What this worker sends for one sum of ``payload`` bytes over every worker."""

    @abc.abstractmethod
    def _sum_flats_(self, flats: list[torch.Tensor]) -> None:
        """Sum each flat tensor over every worker, in place (concurrently where the transport can)."""

    @abc.abstractmethod
    def _register_hook(self, ddp: nn.parallel.DistributedDataParallel, grad_bytes: int) -> int:
        """Register the DDP communication hook; return what one step sends (0: the hook counts)."""

    @property
    def hierarchy(self) -> HostGroups | None:
        """The two levels, for a strategy whose leaders alone talk to a server; None: flat."""
        return None

    def close(self) -> None:  # noqa: B027 - only exchanges holding threads or segments release them
        """Release what the exchange holds (its shared memory, its hook's thread)."""


class FlatExchange(Exchange):
    """Every worker's collectives on the process group, compressed as ``runtime`` says.

    ``successor_elsewhere``: the next rank of the ring (``rank + 1`` mod the world) runs on
    another host. gloo's ring all-reduce and all-gather send each worker's counted bytes to
    that successor, so then all of them leave this host and count as ``bytes_across_hosts``
    (NCCL picks its own ring order from the topology: not counted there)."""

    def __init__(
        self,
        world_size: int,
        control: dist.ProcessGroup | None = None,
        runtime: RuntimeConfig | None = None,
        on_cpu: bool = True,
        successor_elsewhere: bool = False,
    ) -> None:
        super().__init__(world_size, control)
        self._successor_elsewhere = successor_elsewhere
        self._runtime = runtime or RuntimeConfig()
        self._on_cpu = on_cpu
        self.name = dist.get_backend() if dist.is_initialized() else "none"
        codec = codec_for(self._runtime.compression, self._runtime.topk_ratio)
        self._average: CompressedAverage | None = None
        if codec is not None and world_size > 1:
            self._average = CompressedAverage(ErrorFeedback(codec, self._runtime.error_feedback))
        self._compressed_hook: CompressedAllReduce | None = None

    def remember(self, named: NamedBucket) -> None:
        if self._average is not None:
            self._average.remember(named)

    def weighted_sum_(
        self, buckets: Sequence[NamedBucket], own_weight: float, lossless: bool = False
    ) -> None:
        if self._average is None or lossless:  # uncompressed, or a single worker (nothing to compress)
            super().weighted_sum_(buckets, own_weight)
        else:
            self.traffic.bytes_sent += self._average(buckets, own_weight)

    def start_weighted_sum(self, buckets: Sequence[NamedBucket], own_weight: float) -> PendingSum:
        if self._average is not None or self.world_size == 1:  # a codec's average is made at once
            return super().start_weighted_sum(buckets, own_weight)
        flats = [
            torch.cat([t.detach().reshape(-1) for _, t in bucket]).mul_(own_weight) for bucket in buckets
        ]
        works = [dist.all_reduce(flat, async_op=True) for flat in flats]
        self.traffic.bytes_sent += self.sum_bytes(sum(flat.numel() * flat.element_size() for flat in flats))
        return PendingSum(flats, works)

    def count_gradient_step(self) -> None:
        super().count_gradient_step()
        if self._compressed_hook is not None:
            self.traffic.bytes_sent += self._compressed_hook.bytes_sent
            self._compressed_hook.bytes_sent = 0

    def sum_bytes(self, payload: int) -> int:
        return ring_allreduce_bytes(payload, self.world_size)

    def take_traffic(self) -> Traffic:
        taken = super().take_traffic()
        if self._successor_elsewhere and self.name == "gloo":
            taken.bytes_across_hosts = taken.bytes_sent
        return taken

    def _sum_flats_(self, flats: list[torch.Tensor]) -> None:
        if self.world_size > 1:
            for work in [dist.all_reduce(flat, async_op=True) for flat in flats]:
                work.wait()

    def _register_hook(self, ddp: nn.parallel.DistributedDataParallel, grad_bytes: int) -> int:
        runtime, world = self._runtime, self.world_size
        compression = runtime.compression
        if compression is Compression.FP16:
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            return ring_allreduce_bytes(grad_bytes // 2, world)
        if compression is Compression.BF16:
            ddp.register_comm_hook(None, bf16_allreduce_hook)
            return ring_allreduce_bytes(grad_bytes // 2, world)
        if compression is Compression.POWERSGD:
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=runtime.powersgd_rank,
                start_powerSGD_iter=2,  # DDP rebuilds its buckets after the first step
                use_error_feedback=runtime.error_feedback,
            )
            if self._on_cpu and torch.cuda.is_available():
                ddp.register_comm_hook(state, cpu_powersgd_hook)
            else:
                ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            return ring_allreduce_bytes(powersgd_bytes(ddp.module, runtime.powersgd_rank), world)
        if compression in (Compression.ONEBIT, Compression.TOPK):
            codec = OneBit() if compression is Compression.ONEBIT else TopK(runtime.topk_ratio)
            self._compressed_hook = CompressedAllReduce(ErrorFeedback(codec, runtime.error_feedback))
            ddp.register_comm_hook(self._compressed_hook, CompressedAllReduce.hook)
            return 0  # the hook counts what it sends
        return ring_allreduce_bytes(grad_bytes, world)


class HostMemoryExchange(Exchange):
    """Every worker on one host: sums through the host's shared-memory segment.

    Chosen only for a plain sum (no compression): every worker writes its tensor into the
    segment once, and reads the sum back.
    """

    name = "shared_memory"

    def __init__(self, shared: SharedMemoryGroup, world_size: int, control: dist.ProcessGroup | None) -> None:
        super().__init__(world_size, control)
        self._shared = shared

    def sum_control_(self, tensor: torch.Tensor) -> None:
        self._shared.all_reduce_(tensor)

    def sum_(self, tensor: torch.Tensor) -> None:
        self._shared.all_reduce_(tensor)

    def sum_bytes(self, payload: int) -> int:
        return payload  # each worker's tensor, into the shared segment

    def _sum_flats_(self, flats: list[torch.Tensor]) -> None:
        for flat in flats:
            self._shared.all_reduce_(flat)

    def _register_hook(self, ddp: nn.parallel.DistributedDataParallel, grad_bytes: int) -> int:
        ddp.register_comm_hook(self._shared, shared_memory_hook)
        return grad_bytes

    def close(self) -> None:
        self._shared.close()


class HierarchicalExchange(Exchange):
    """Two levels: within the host (its shared memory where it has it), then among the
    hosts' leaders; what leaves the host is counted in ``traffic.bytes_across_hosts``."""

    def __init__(self, hierarchy: HostGroups, world_size: int, control: dist.ProcessGroup | None) -> None:
        super().__init__(world_size, control)
        self._hierarchy = hierarchy
        backend = dist.get_backend()
        self.name = backend if hierarchy.shared is None else f"shared_memory+{backend}"
        self._hook: HierarchicalAllReduce | None = None

    @property
    def hierarchy(self) -> HostGroups:
        return self._hierarchy

    def count_gradient_step(self) -> None:
        super().count_gradient_step()
        if self._hook is not None:
            self.traffic.bytes_across_hosts += self._hook.bytes_across_hosts
            self._hook.bytes_across_hosts = 0

    def sum_bytes(self, payload: int) -> int:
        return hierarchical_bytes(self._hierarchy, payload)

    def _sum_flats_(self, flats: list[torch.Tensor]) -> None:
        for flat in flats:  # one after the other through the two levels
            self.traffic.bytes_across_hosts += self._hierarchy.all_reduce(flat)

    def _register_hook(self, ddp: nn.parallel.DistributedDataParallel, grad_bytes: int) -> int:
        self._hook = HierarchicalAllReduce(self._hierarchy, self.world_size)
        ddp.register_comm_hook(self._hook, HierarchicalAllReduce.hook)
        return hierarchical_bytes(self._hierarchy, grad_bytes)

    def take_hook_failure(self) -> BaseException | None:
        return self._hook.take_failure() if self._hook is not None else None

    def gather_(self, flat: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
        raise ClusterConfigError(
            "a two-level exchange sums within each host first and has no gather across hosts; "
            "set runtime.hierarchy = 'none' for sufficient_factors"
        )

    def close(self) -> None:
        if self._hook is not None:
            self._hook.close()
        if self._hierarchy.shared is not None:  # the groups stay; the next exchange shares afresh
            self._hierarchy.shared.close()
            self._hierarchy.shared = None
