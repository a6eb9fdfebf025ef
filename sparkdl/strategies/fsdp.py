"""Sharded data parallelism with PyTorch's FSDP2 (``fully_shard``): for models whose
parameters, gradients and optimizer state do not fit one worker together.

Each rank keeps 1/N of every parameter, of its gradient and of the optimizer state (the
optimizer is built over the shards, so Adam's moments are sharded too). A forward
gathers one unit's full parameters at a time and frees them after it; backward gathers
them again and reduce-scatters the gradients, so each rank ends with the mean
gradient's shard. gloo on CPU, NCCL on GPU: the process group the worker already has.

Step math: the same as all-reduce. Every worker scales its mean loss by
``world * rows / global_rows`` and FSDP averages over the workers, so the step equals
single-process SGD on the union of the step's rows, however unevenly they are spread.
Forward and backward are collectives, so every rank runs the same number of them: a
worker without rows steps on zero-weight fillers, and every step runs
``accumulate_steps`` micro-batches, fillers making up a short step.

Frozen parameters (``requires_grad = False``: a LoRA model's base) are sharded and
gathered like the others (the forward needs them whole; sharding them is the memory this
strategy saves), but have no gradient: FSDP2 reduce-scatters only the trainable ones, and
the optimizer holds no state for them. A checkpoint holds each parameter once, gathered.
The bytes a rank sends are counted as FSDP2 runs its collectives (:class:`CountedAllGather`,
:class:`CountedReduceScatter`), not estimated: a frozen unit whose input needs no gradient
(a frozen embedding first in the model) is not gathered again for backward, and the root's
own parameters stay gathered from forward to backward.

Accumulation: each micro-batch's backward reduce-scatters its gradient into the shards,
where they add up. Deferring the reduction to the last micro-batch
(``set_requires_gradient_sync(False)``) would move fewer bytes, but would hold an
unsharded gradient of the whole model on every rank: the memory this strategy exists
to save.

Wrapping: each submodule holding at least :data:`UNIT_SHARE` of the model's parameters
(counted bottom-up, without those already in a smaller unit) becomes its own unit, and so
does each run of smaller sibling layers that together hold as much; then the root takes
the rest. Units bound the peak: at most about one unit's full parameters
are gathered beyond the shards. Many tiny units would add one collective each for
nothing; one unit for the whole model would gather it whole.

Checkpoints are gathered (full, unsharded), written by rank 0 in the format of the other
strategies (``module.state_dict()``, and ``optimizer.state_dict()`` numbering the
parameters in order), so one resume path reads them all and a checkpoint moves between
strategies and worker counts. Gathering is a collective: every rank takes part at each
checkpoint step; on resume every rank reads the file and keeps its shards. The final
weights and early stopping's best weights are gathered the same way, to rank 0.

Building: only rank 0 builds the whole model (on CPU); every rank builds it on the meta
device, shards it, allocates its shards and receives them from rank 0, so the other
ranks never hold it whole (:meth:`FsdpStrategy.build_module`).

Buffers (e.g. batch-norm statistics) are not sharded and, unlike DDP, not synchronised:
each rank keeps its own; rank 0's are saved and returned.

In a user's own loop every rank starts from rank 0's weights, then the model is sharded in
place (:meth:`FsdpStrategy.prepare_own_module`) and the optimizer given with it is pointed
at the shards (it must not have stepped yet). Each rank's gradient is scaled by the step's
share inside the reduce-scatter (:class:`ScaledReduceScatter`), so uneven partitions are
exact as under all-reduce; ``ctx.state_dict`` gathers the whole model to rank 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from sparkdl.comm.traffic import Pattern
from sparkdl.config import SparkDLConfig, Strategy
from sparkdl.errors import ConfigError
from sparkdl.strategies.distributed_state import FROM_RANK0, DistributedState
from sparkdl.strategies.rules import refuse_compression, refuse_fp16, refuse_hierarchy
from sparkdl.training.factory import build_model, build_on_meta, checkpoint_layers
from sparkdl.training.own_loop import OwnLoopFace, RunningStep
from sparkdl.training.strategy import (
    CollectiveForward,
    StepInput,
    StepOutcome,
    StrategyContext,
)

#: A submodule with at least this share of the parameters is sharded as its own unit.
UNIT_SHARE = 0.05


class FsdpStrategy(DistributedState, CollectiveForward):
    """w <- w - lr * mean_i(g_i), with w, g and the optimizer state sharded over the ranks."""

    name = Strategy.FSDP
    compiles = False  # its own build_module; training.compile refused
    pattern = Pattern.FULL_SHARD
    shares_gradients = True
    shards_parameters = True
    serves_own_loop = True

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self._micro_batches = ctx.config.training.accumulate_steps
        self._sent = count_collectives(ctx.module)

    @classmethod
    def check_settings(cls, config: SparkDLConfig) -> None:
        refuse_fp16(
            config,
            "its gradient scaler would have to agree on overflows across the gradient shards",
            "or strategy = 'allreduce'",
        )
        refuse_compression(config, "its gathers and reduce-scatters have no compression hook")
        refuse_hierarchy(config, "its collectives are FSDP's own")

    @classmethod
    def build_module(
        cls,
        model_fn: Callable[[], nn.Module],
        config: SparkDLConfig,
        device: torch.device,
        parallelize_fn: Callable[[nn.Module, Any], object] | None = None,
    ) -> nn.Module:
        """Rank 0 builds the whole model on CPU; every rank builds it on the meta device
        (no memory), shards it, allocates only its shards and receives them from rank 0.
        So no other rank ever holds the whole model. A model with buffers outside its
        state dict (non-persistent: nothing could fill them after allocation) is built
        whole on every rank and sharded (:meth:`prepare_module`)."""
        skeleton = build_on_meta(model_fn)
        saved = set(skeleton.state_dict())
        if any(name not in saved for name, _ in skeleton.named_buffers()):
            module = build_model(model_fn).to(device)
            if config.training.activation_checkpointing:
                checkpoint_layers(module)  # before sharding: FSDP2 wraps the checkpointed layers
            return cls.prepare_module(module, config, device)
        whole = None
        if dist.get_rank() == 0:
            with torch.random.fork_rng(devices=[]):  # every rank leaves with the same random state
                whole = build_model(model_fn)
        if config.training.activation_checkpointing:
            checkpoint_layers(skeleton)  # before sharding: FSDP2 wraps the checkpointed layers
        _shard(skeleton, device)
        skeleton.to_empty(device=device)
        state = whole.state_dict() if whole is not None else {}
        set_model_state_dict(skeleton, cast(dict[str, Any], state), options=FROM_RANK0)
        return skeleton

    @classmethod
    def prepare_module(cls, module: nn.Module, config: SparkDLConfig, device: torch.device) -> nn.Module:
        """Start every rank from rank 0's weights (as DDP does), then shard ``module`` in
        place: :func:`shard_units`, then the root."""
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        _shard(module, device)
        return module

    @classmethod
    def prepare_own_module(
        cls, module: nn.Module, optimizer: torch.optim.Optimizer, config: SparkDLConfig, device: torch.device
    ) -> None:
        """Shard a user's ``module`` in place (every rank from rank 0's weights) and point
        ``optimizer``, built over its whole parameters, at the shards that replaced them (by
        name).

        Raises:
            ConfigError: the optimizer has stepped already (its state is of the whole
                parameters); this torch has no custom reduce-scatter.
        """
        _refuse_stepped_optimizer(optimizer, cls.name.value)
        from torch.distributed.fsdp import FSDPModule

        if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
            raise ConfigError(
                f"strategy = 'fsdp' in your own loop needs FSDPModule.set_custom_reduce_scatter, which "
                f"torch {torch.__version__} lacks; install a newer torch, or use allreduce"
            )
        names = {id(p): name for name, p in module.named_parameters()}
        cls.prepare_module(module, config, device)
        shards = dict(module.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [shards[names[id(p)]] for p in group["params"]]
        cast(Any, module).set_requires_gradient_sync = _deferred_sync_refused

    def own_loop(self, optimizer: torch.optim.Optimizer, step: RunningStep) -> OwnLoopFace:
        from torch.distributed.fsdp import FSDPModule

        for unit in self.ctx.module.modules():
            if isinstance(unit, FSDPModule):
                # FSDP's ReduceScatter interface, by its two methods (torch exports no name for it)
                unit.set_custom_reduce_scatter(
                    cast(Any, CountedReduceScatter(self._sent, lambda: step.scale))
                )
        return _ShardedFace(self, optimizer, self.ctx.rank)

    def train_step(self, step: StepInput) -> StepOutcome:
        scale = self.ctx.world_size * step.rows / step.global_rows
        fillers = self._micro_batches - len(step.batches)
        loss = self._backward(step, step.batches, scale, fillers)
        self.stats.sync_rounds += 1
        self.stats.bytes_sent += self._sent.take()
        return self._step_on_shared_gradients(step, loss)


class _CustomCollective:
    """What FSDP2 asks of a custom collective beside the call: its output buffers, plain ones."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class ScaledReduceScatter(_CustomCollective):
    """FSDP2's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) with this rank's
    gradient first scaled by ``scale()``: a user's own loop, whose loss sparkdl does not see,
    weights each rank's gradient by its share of the step's rows here. A share of 0 (a
    filler) zeroes the gradient rather than multiplying it (an infinity would become NaN)."""

    def __init__(self, scale: Callable[[], float]) -> None:
        self._scale = scale

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        scale = self._scale()
        if scale == 0.0:
            input_tensor.zero_()
        elif scale != 1.0:
            input_tensor.mul_(scale)
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class _ShardedFace(OwnLoopFace):
    """A sharded model in a user's own loop: its one optimizer's whole state is gathered
    from the shards, and loaded into them."""

    def __init__(self, strategy: FsdpStrategy, optimizer: torch.optim.Optimizer, rank: int) -> None:
        super().__init__(strategy, optimizer, rank)
        self._strategy = strategy

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self._strategy.full_optimizer_state_dict()

    def load_optimizer_state(self, optimizer: Any, state: dict[str, Any]) -> None:
        self._strategy.load_whole_optimizer(state)


class SentBytes:
    """Bytes this rank sent in FSDP's collectives since the last :meth:`take`."""

    def __init__(self) -> None:
        self._sent = 0

    def add(self, tensor: torch.Tensor, group: dist.ProcessGroup, gathered: bool) -> None:
        """A ring collective over ``size`` ranks: an all-gather sends ``size - 1`` copies of
        the rank's input shard; a reduce-scatter ``(size - 1) / size`` of its whole input."""
        size = group.size()
        self._sent += (size - 1) * tensor.nbytes if gathered else (size - 1) * tensor.nbytes // size

    def take(self) -> int:
        sent, self._sent = self._sent, 0
        return sent


class CountedAllGather(_CustomCollective):
    """FSDP2's all-gather (``FSDPModule.set_custom_all_gather``), its bytes counted."""

    def __init__(self, sent: SentBytes) -> None:
        self._count = sent

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        self._count.add(input_tensor, group, gathered=True)
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountedReduceScatter(ScaledReduceScatter):
    """FSDP2's reduce-scatter, its bytes counted (the gradients unscaled: the step's loss
    carries each rank's share)."""

    def __init__(self, sent: SentBytes, scale: Callable[[], float] = lambda: 1.0) -> None:
        super().__init__(scale)
        self._count = sent

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        self._count.add(input_tensor, group, gathered=False)
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def count_collectives(module: nn.Module) -> SentBytes:
    """Count the bytes of every unit's all-gathers and reduce-scatters from now on (a torch
    without FSDP's custom collectives counts nothing)."""
    from torch.distributed.fsdp import FSDPModule

    sent = SentBytes()
    for unit in module.modules():
        if isinstance(unit, FSDPModule) and hasattr(unit, "set_custom_all_gather"):
            unit.set_custom_all_gather(cast(Any, CountedAllGather(sent)))
            unit.set_custom_reduce_scatter(cast(Any, CountedReduceScatter(sent)))
    return sent


def _refuse_stepped_optimizer(optimizer: torch.optim.Optimizer, strategy: str) -> None:
    """A strategy that replaces the model's parameters (their shards) needs an optimizer
    whose state is still to be built over them.

    Raises:
        ConfigError: the optimizer holds state already.
    """
    if optimizer.state:
        raise ConfigError(
            f"ctx.prepare got a {type(optimizer).__name__} that holds state already (it stepped, or it "
            f"builds its state when constructed, as Adagrad does); with strategy = {strategy!r} its "
            "state must be built over the shards: prepare the model and optimizer before the first "
            "step (load a checkpoint with ctx.load_state_dict after), or use an optimizer that builds "
            "its state at its first step"
        )


def _deferred_sync_refused(*_: object, **__: object) -> None:
    raise ConfigError(
        "set_requires_gradient_sync on a model ctx.prepare sharded: sparkdl weights each step's gradient "
        "by its rows as FSDP reduce-scatters it, so a reduction deferred over several steps would weight "
        "them all by the last one; accumulate by calling backward on each micro-batch (each reduces at once)"
    )


def _shard(module: nn.Module, device: torch.device) -> None:
    """``fully_shard`` each of :func:`shard_units`, then the root, over every rank."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in shard_units(module):
        fully_shard(unit, mesh=mesh)
    fully_shard(module, mesh=mesh)


def shard_units(module: nn.Module, share: float = UNIT_SHARE) -> list[nn.Module | list[nn.Module]]:
    """What of ``module`` (not itself) to shard as units, innermost first: each submodule
    holding at least ``share`` of all parameters, not counting those of units inside it;
    and where a module's children are each smaller than that, runs of them (in order) that
    together hold ``share``, each run one unit (``fully_shard`` of a list: one gather for
    the run). Without the runs, a flat ``nn.Sequential`` of many small layers had no unit
    but the root, which gathered the whole model at once (fsdp peaked at 1.45x all-reduce's
    memory on 61 x Linear(4096, 4096), session 20). Innermost first is the order
    ``fully_shard`` needs (a unit's parameters belong to the innermost unit that holds them)."""
    total = sum(p.numel() for p in module.parameters())
    threshold = share * total
    units: list[nn.Module | list[nn.Module]] = []

    def visit(node: nn.Module) -> int:
        """Parameters under ``node`` not yet in a unit."""
        run: list[nn.Module] = []
        in_run = 0
        for child in node.children():
            free = visit(child)
            if not free:  # a unit already, or nothing to shard
                continue
            run.append(child)
            in_run += free
            if in_run >= threshold:
                units.append(run[0] if len(run) == 1 else run)
                run, in_run = [], 0
        free = in_run + sum(p.numel() for p in node.parameters(recurse=False))
        if node is not module and total and free >= threshold:
            units.append(node)
            return 0
        return free

    visit(module)
    return units
