"""Tensor parallelism: large linear layers (and embeddings) split across the workers of a group, with
PyTorch's DTensor (``parallelize_module``), as Megatron splits a transformer's MLP.

The plan (:func:`megatron_plan`): in every module, each ``nn.Linear`` followed (past
layers without parameters: activations, dropout) by another whose input is the first's
output is a pair: the first is split by columns (each worker computes a slice of the
hidden features), the second by rows (each worker multiplies its slice; one all-reduce
sums the partial outputs). A pair costs one all-reduce of the output forward and one of
the input's gradient backward; the weights never move. Layers outside a pair stay whole
on every worker of the group.

Layout: ``tp_size`` consecutive ranks form a group (a 2-D mesh, ``("dp", "tp")``): its
all-reduces run every layer pair, so they stay on a host where Spark places consecutive
tasks together; with more workers the groups are data-parallel replicas, each rank's
gradients (its shards) summed over its replicas once a step.

A step's rows: every worker of a group computes on the same rows (a split layer needs
every row on every worker), so the group's rows are gathered to each of its workers, and
every worker of the group computes the same loss on their union, scaled by
``union rows / global_rows``: after the sum over the replicas, the mean gradient over every
row of the step, as single-process SGD on their union. Called as a module outside the
step (validation, the label probe), the model gathers the group's rows the same way and
returns each worker its own rows' outputs.

Random draws (dropout). The workers of a group compute on the same rows, so a layer every
worker holds whole must draw the same mask on each: the group shares one random stream
(:attr:`TensorParallelStrategy.random_stream`, its replica's, also when checkpoints reseed it
per step). Between the two layers of a pair each worker holds a slice of the hidden
features, and its slice needs a mask of its own: those layers draw from a stream of the
worker's own (:class:`_SliceRandom`, as Megatron's model-parallel RNG tracker does), seeded
from the shared one, so that a resumed run and an activation checkpoint's recompute draw the
same masks again. A parameter of a layer between the two (a PReLU's weight) sees one slice:
its gradient is summed over the group. At the end (and before each validation) the layers
every worker holds whole are compared over the group; a difference is logged with the
layers' names.

Checkpoints and the final weights are gathered whole to rank 0
(:class:`~sparkdl.strategies.distributed_state.DistributedState`), in every strategy's format.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from sparkdl.comm.traffic import Pattern
from sparkdl.config import SparkDLConfig, Strategy
from sparkdl.data.tensors import Batch
from sparkdl.errors import ConfigError
from sparkdl.strategies.distributed_state import DistributedState
from sparkdl.strategies.gradients import local_part, sum_gradients, sum_parameter_gradients
from sparkdl.strategies.rows import padded, row_counts
from sparkdl.strategies.rules import refuse_compression, refuse_fp16, refuse_hierarchy
from sparkdl.strategies.tensor_plan import (
    COLUMNS,
    ROWS,
    VOCABULARY,
    check_parallelize_fn,
    hugging_face_plan,
    inside_pairs,
    megatron_plan,
    refuse_untied,
    split_layers,
    users_plan,
)
from sparkdl.training.factory import build_model, checkpoint_layers, tied_parameters
from sparkdl.training.strategy import CollectiveForward, StepInput, StepOutcome, StrategyContext

__all__ = [  # the plans are tensor_plan.py's (pure): re-exported where the strategy is
    "COLUMNS",
    "ROWS",
    "VOCABULARY",
    "TensorParallelStrategy",
    "check_parallelize_fn",
    "megatron_plan",
]


log = logging.getLogger(__name__)


class TensorParallelStrategy(DistributedState, CollectiveForward):
    """w <- w - lr * mean_i(g_i), with each pair of linear layers split over a group."""

    name = Strategy.TENSOR
    compiles = False  # its own build_module; training.compile refused
    takes_parallelize_fn = True
    pattern = Pattern.TENSOR
    resizes = False
    shares_gradients = True

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        groups = cast(_Groups, getattr(ctx.module, _GROUPS))
        self._groups = groups
        self._tp, self._dp = groups.tp, groups.dp

    @property
    def random_stream(self) -> int:
        """The group's replica: every worker of a group draws the same masks where it holds
        the same layers (inside a split pair, :class:`_SliceRandom` gives each its own)."""
        return int(self._dp.get_local_rank())

    @classmethod
    def check_settings(cls, config: SparkDLConfig) -> None:
        world, size = config.training.num_workers, config.tensor.tp_size or config.training.num_workers
        if size < 2:
            raise ConfigError(
                f"strategy = 'tensor' needs a group of at least 2 workers (tensor.tp_size = "
                f"{config.tensor.tp_size}, num_workers = {world}); with one worker use strategy = 'allreduce'"
            )
        if world % size:
            raise ConfigError(
                f"num_workers = {world} is not a multiple of tensor.tp_size = {size}; set num_workers to "
                f"{size * max(1, world // size)} or tp_size to a divisor of it"
            )
        refuse_fp16(config, "its gradient scaler cannot agree on overflows across split layers")
        refuse_compression(config)
        refuse_hierarchy(config)

    @classmethod
    def build_module(
        cls,
        model_fn: Callable[[], nn.Module],
        config: SparkDLConfig,
        device: torch.device,
        parallelize_fn: Callable[[nn.Module, Any], object] | None = None,
    ) -> nn.Module:
        """Build the whole model (the same on every rank: the seed is set), then split it over
        this rank's group, each rank keeping its slices: by the built-in plan (or
        ``tensor_plan``), or by the user's ``parallelize_fn(module, mesh)``."""
        module = build_model(model_fn).to(device)
        if config.training.activation_checkpointing:
            checkpoint_layers(module)  # before the split: its hooks run inside the checkpoint's
        world = dist.get_world_size()
        size = config.tensor.tp_size or world
        mesh = _mesh(device, world, size, config.runtime.collective_timeout_s)
        tied = tied_parameters(module)
        if parallelize_fn is not None:
            parallelize_fn(module, mesh["tp"])
            plan = split_layers(module, size)
        else:
            plan = cls.plan(module, size, config.tensor.tensor_plan)
            styles: dict[str, ParallelStyle] = {
                name: {
                    COLUMNS: ColwiseParallel(),
                    ROWS: RowwiseParallel(),
                    VOCABULARY: RowwiseParallel(input_layouts=Replicate()),  # every worker sees every id
                }[how]
                for name, how in plan.items()
            }
            parallelize_module(module, mesh["tp"], styles)
        refuse_untied(tied, tied_parameters(module))
        groups = _Groups(mesh)
        slice_random = _SliceRandom(device, dist.get_rank())
        for name in inside_pairs(module, plan):  # each worker runs these on its slice
            layer = module.get_submodule(name)
            layer.register_forward_pre_hook(slice_random.enter)
            layer.register_forward_hook(slice_random.leave)
            groups.sliced.extend(
                p for p in layer.parameters() if p.requires_grad and not hasattr(p, "placements")
            )
        for name, how in plan.items():
            layer = module.get_submodule(name)
            if how in (ROWS, VOCABULARY):  # forward: the partial outputs summed
                layer.register_forward_hook(groups.count_output)
            else:  # backward: the input's partial gradients summed (where it has one)
                layer.register_forward_pre_hook(groups.count_input_gradient)
        setattr(module, _GROUPS, groups)
        module.register_forward_pre_hook(groups.gather_inputs, with_kwargs=True)
        module.register_forward_hook(groups.own_outputs)
        return module

    @classmethod
    def check_model(cls, module: nn.Module, config: SparkDLConfig) -> None:
        cls.plan(module, config.tensor.tp_size or config.training.num_workers, config.tensor.tensor_plan)

    @classmethod
    def plan(cls, module: nn.Module, size: int, given: Sequence[str] = ()) -> dict[str, str]:
        """The user's ``tensor_plan`` if given, else a Hugging Face decoder's own plan
        (:func:`hugging_face_plan`: its attention and MLP blocks), else :func:`megatron_plan`;
        refused when it splits nothing.

        Raises:
            ConfigError: a ``tensor_plan`` entry names no layer of its kind, a way to split
                other than columns, rows and vocabulary, or a size that does not divide;
                or the model has nothing to split in ``size``.
        """
        given = given or hugging_face_plan(module)
        if given:
            return users_plan(module, size, given)
        plan = megatron_plan(module, size)
        if not plan:
            raise ConfigError(
                "strategy = 'tensor' found nothing to split in the model: no pair of linear layers (an "
                "nn.Linear followed by one that takes its output, a hidden width divisible by tp_size = "
                f"{size}) and no nn.Embedding whose vocabulary divides by it; use strategy = 'fsdp' or "
                "'pipeline' for this model"
            )
        return plan

    def train_step(self, step: StepInput) -> StepOutcome:
        """Each micro-batch (``accumulate_steps``) is the group's rows of it, gathered and run
        on its own, so activations weigh one micro-batch of the group's rows at a time."""
        device = self.ctx.device
        batches = list(step.batches)
        counts = row_counts(len(batches), self._tp.get_group(), device)  # micro-batches this step, per worker
        unions = []
        for i in range(max(counts)):
            local = batches[i] if i < len(batches) else step.filler().head(0)
            union = self._groups.group_rows(local.to(device))
            if len(union):
                unions.append(union)
        rows = sum(len(union) for union in unions)
        if rows:
            with self._groups.within_step():
                loss = self._backward(step, tuple(unions), rows / step.global_rows)
        else:  # the whole group is out of rows: its replicas' gradients only
            loss = torch.zeros((), device=device)
        if self._groups.sliced:  # a layer inside a pair saw one slice: the group's sum is its gradient
            self.stats.bytes_sent += sum_parameter_gradients(self._groups.sliced, self._tp.get_group())
        if self._dp.size() > 1:
            self.stats.bytes_sent += sum_gradients(self.ctx.module, self._dp.get_group())
        self.stats.sync_rounds += 1
        self.stats.bytes_sent += self._groups.take_sent()
        return self._step_on_shared_gradients(step, loss)

    def finish(self) -> None:
        """Every worker's weights are final: check that the layers every worker of the group
        holds whole are the same on each (they take the same steps from the same start)."""
        super().finish()
        whole = [(n, p) for n, p in self.ctx.module.named_parameters() if not hasattr(p, "placements")]
        if self._tp.size() < 2 or not whole:
            return
        mine = torch.stack([p.detach().double().sum() for _, p in whole])
        every = [torch.empty_like(mine) for _ in range(self._tp.size())]
        dist.all_gather(every, mine, group=self._tp.get_group())
        sums = torch.stack(every).cpu()  # one copy to the host, however many layers
        own = sums[self._tp.get_local_rank()]
        close = torch.isclose(sums, own.expand_as(sums), rtol=1e-6, atol=1e-9).all(dim=0).tolist()
        apart = [name for (name, _), agrees in zip(whole, close, strict=True) if not agrees]
        if apart:
            log.warning(
                "rank %d: the layers every worker of the tensor-parallel group holds whole differ "
                "between its workers after training: %s (the returned model is rank 0's)",
                self.ctx.rank,
                ", ".join(apart[:8]) + (f" and {len(apart) - 8} more" if len(apart) > 8 else ""),
            )

    def _clip_gradients(self) -> None:
        """Clip by the whole model's gradient norm: the split layers' slices summed over the
        group, the layers every worker holds whole counted once."""
        sliced = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        whole = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        grads = [p.grad for p in self.ctx.module.parameters() if p.grad is not None]
        for g in grads:
            part = local_part(g).detach().double().pow(2).sum()
            placements = getattr(g, "placements", ())
            if any(placement.is_shard() for placement in placements):
                sliced += part
            else:
                whole += part
        dist.all_reduce(sliced, group=self._tp.get_group())
        norm = float((sliced + whole).sqrt())
        factor = self._clip_norm / (norm + 1e-6)
        if factor < 1:
            for g in grads:
                local_part(g).mul_(factor)


_GROUPS = "_sparkdl_tensor_groups"


def _mesh(device: torch.device, world: int, size: int, timeout_s: float) -> DeviceMesh:
    """The ``("dp", "tp")`` mesh of ``world // size`` groups of ``size`` consecutive ranks,
    its process groups bounded by ``timeout_s`` (``runtime.collective_timeout_s``; a mesh's
    own would wait torch's default 30 minutes). Every rank creates every group, in order."""
    rank, layout = dist.get_rank(), torch.arange(world).view(world // size, size)
    timeout = timedelta(seconds=timeout_s)
    own: dict[str, dist.ProcessGroup] = {}
    for dim, lines in (("dp", layout.t()), ("tp", layout)):
        for line in lines.tolist():
            group = dist.new_group(line, timeout=timeout)
            if rank in line:
                own[dim] = group
    return DeviceMesh.from_group(
        [own["dp"], own["tp"]], device.type, mesh=layout, mesh_dim_names=("dp", "tp")
    )


class _SliceRandom:
    """The random stream of the layers inside a split pair, one per worker: entering such a
    layer draws a seed from the group's shared stream (the same draw on every worker of the
    group, so the shared stream stays in step) and seeds the device's generator with it and
    the worker's rank; leaving restores the shared stream. An activation checkpoint restores
    the shared stream before its recompute, so the recompute draws the same masks."""

    def __init__(self, device: torch.device, rank: int) -> None:
        self._cuda = device if device.type == "cuda" else None
        self._offset = (rank + 1) * 0x9E3779B97F4A7C15
        self._outer: list[torch.Tensor] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        seed = int(torch.randint(0, 1 << 62, (1,)))  # the shared CPU stream, the same on the group
        if self._cuda is not None:
            self._outer.append(torch.cuda.get_rng_state(self._cuda))
            torch.cuda.default_generators[self._cuda.index or 0].manual_seed(
                (seed ^ self._offset) % (1 << 63)
            )
        else:
            self._outer.append(torch.get_rng_state())
            torch.manual_seed((seed ^ self._offset) % (1 << 63))

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        outer = self._outer.pop()
        if self._cuda is not None:
            torch.cuda.set_rng_state(outer, self._cuda)
        else:
            torch.set_rng_state(outer)


class _Groups:
    """The mesh, and the hooks that give each worker of a group its own rows' outputs."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.tp, self.dp = mesh["tp"], mesh["dp"]
        self.sliced: list[nn.Parameter] = []  # parameters of the layers inside the pairs
        self.gathering = True  # off inside a step, whose rows are already the group's
        self._own: tuple[int, int] | None = None
        size = self.tp.size()
        self._ring = 2 * (size - 1) / size  # what one rank sends of an all-reduced tensor
        self._sent = 0.0

    def count_output(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self._sent += self._ring * local_part(output).nbytes

    def count_input_gradient(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            self._sent += self._ring * local_part(args[0]).nbytes

    @contextlib.contextmanager
    def within_step(self) -> Iterator[None]:
        """The model called on the group's rows: nothing to gather."""
        self.gathering = False
        try:
            yield
        finally:
            self.gathering = True

    def take_sent(self) -> int:
        """Bytes this rank sent in the split layers' all-reduces since the last call."""
        sent, self._sent = self._sent, 0.0
        return int(sent)

    def group_rows(self, batch: Batch) -> Batch:
        """The group's rows of this step, the same on every worker of the group (what this rank
        sent counted: its rows, padded to the group's most, to each other rank)."""
        device = next(iter(batch.inputs.values())).device
        counts = row_counts(len(batch), self.tp.get_group(), device)
        tensors = [*batch.inputs.values(), batch.label, batch.weight]
        row_bytes = sum(t.element_size() * math.prod(t.shape[1:]) for t in tensors if t is not None)
        self._sent += (len(counts) - 1) * max(counts) * row_bytes
        gather = lambda t: None if t is None else _all_gather_rows(t, counts, self.tp)  # noqa: E731
        return Batch(
            {name: _all_gather_rows(t, counts, self.tp) for name, t in batch.inputs.items()},
            gather(batch.label),
            gather(batch.weight),
        )

    def gather_inputs(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self.gathering:
            return None
        names = [f"arg{i}" for i in range(len(args))] + list(kwargs)
        values = [*args, *kwargs.values()]
        rows = len(values[0])
        counts = row_counts(rows, self.tp.get_group(), values[0].device)
        start = sum(counts[: self.tp.get_local_rank()])
        self._own = (start, rows)
        joined = [_all_gather_rows(v, counts, self.tp) for v in values]
        return tuple(joined[: len(args)]), dict(zip(names[len(args) :], joined[len(args) :], strict=True))

    def own_outputs(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if not self.gathering or self._own is None:
            return None
        start, rows = self._own
        self._own = None
        return output[start : start + rows]


def _all_gather_rows(tensor: torch.Tensor, counts: Sequence[int], mesh: DeviceMesh) -> torch.Tensor:
    """Every worker's rows of ``tensor``, joined in the group's order, on every worker."""
    part = padded(tensor, counts).contiguous()
    every = [torch.empty_like(part) for _ in counts]
    dist.all_gather(every, part, group=mesh.get_group())
    return torch.cat([part[:count] for part, count in zip(every, counts, strict=True)])
