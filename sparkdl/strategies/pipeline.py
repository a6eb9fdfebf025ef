"""Pipeline parallelism: the model cut into stages, one per worker, fed micro-batches
under a schedule (GPipe or 1F1B) by PyTorch's ``torch.distributed.pipelining``.

Layout: ``stages`` consecutive ranks form one pipeline (rank ``r`` runs stage
``r % stages`` of pipeline ``r // stages``); with more workers than stages the pipelines
are data-parallel replicas of each other (DistBelief's layout), each stage's gradients
all-reduced over its replicas after the last micro-batch's backward. (DDP wrapped around a
stage failed its bucket rebuild under 1F1B in torch 2.13: "rebuilt parameter indices size
is not same as original model parameters size".) Consecutive
ranks share a host where Spark places them so: activations, which cross every micro-batch,
stay on the host; the once-a-step gradient all-reduce crosses hosts.

The cut: the model's top-level layers (an ``nn.Sequential``'s children; the activation
between two of them is one tensor) in contiguous runs, starting where ``split_before``
names, or where each stage gets about the same number of parameters (:func:`balance`).
Each worker keeps only its stage's layers, under their names in the whole model, so its
state dict is a slice of the whole model's.

A step's rows: every worker of a pipeline reads its own partition, as with every other
strategy. The inputs of the step's rows go to stage 0 and their labels to the last stage
(one gather each in the pipeline's group), so a row crosses the network at most once
each way. Stage 0 pads the pipeline's rows to a fixed number (``microbatches`` micro-batches
of the same size, the shapes the stages agreed on at the first step) with copies of a row
it saw; the last stage's loss leaves the padding out.

Step math: the loss of a micro-batch of ``k`` real rows is scaled by ``k / global_rows``,
so after the sum over micro-batches and over the replicas (one all-reduce of the stage's
gradients, flattened) each stage holds the mean gradient over every row of the step: single-process SGD
on the union of the step's rows, whatever the number of micro-batches or how unevenly the
rows are spread. One world-wide sum of the loss (and of whether any gradient was non-finite)
per step gives every rank the same loss and the same NaN verdict. Gradient clipping takes
the norm over every stage.

Tied weights: a parameter the model holds under several names (a language model's head tied
to its embedding) whose layers land on several stages is a copy on each; after a step's
backward the copies' gradients are summed over those stages (one all-reduce per tie in
their own group), and the clipping norm counts it once, so every copy takes the same step.

Called as a module, a worker's stage runs the whole pipeline forward (inference, in
lockstep with its pipeline: :class:`~sparkdl.training.strategy.CollectiveForward`), so
validation, the label probe and early stopping work unchanged. Checkpoints, the final
weights and early stopping's best weights are the whole model's, gathered to rank 0 in the
format of every other strategy: a checkpoint moves between strategies and worker counts.

Limits: a model of one input tensor whose top level is an ``nn.Sequential`` (a model of
several inputs is cut by hand into a Sequential whose first layer takes one tensor), or a
Hugging Face decoder with a pipeline plan, taken as its embedding, blocks and head
(:mod:`~sparkdl.strategies.pipeline_decoder`);
``precision = "fp16"``, compression and hierarchy are refused. Padding rows go through
the layers (a batch-norm layer would count them). Rank 0 builds the whole model once, on
the CPU, and sends every other rank its stage, which they allocate alone.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from sparkdl.comm.traffic import Pattern
from sparkdl.config import PipelineSchedule, SparkDLConfig, Strategy
from sparkdl.data.tensors import join_batches
from sparkdl.errors import ConfigError
from sparkdl.strategies.gradients import sum_gradients
from sparkdl.strategies.pipeline_decoder import checked_pipeline_layers, pipeline_layers
from sparkdl.strategies.pipeline_layout import Layout, stage_starts
from sparkdl.strategies.pipeline_stage import StageLayers, StageModule, build_stage
from sparkdl.strategies.pipeline_transfer import (
    StepRows,
    gather_rows,
    merged_dicts,
    merged_optimizer_states,
    pad_rows,
    received_tensor,
    to_cpu,
    with_tensors,
    without_tensors,
)
from sparkdl.strategies.rows import row_counts
from sparkdl.strategies.rules import refuse_compression, refuse_fp16, refuse_hierarchy
from sparkdl.training.factory import cpu_state_dict
from sparkdl.training.optimizer_state import indexed_to_named, named_to_indexed, parameter_names
from sparkdl.training.strategy import (
    CollectiveForward,
    StepInput,
    StepOutcome,
    StrategyContext,
    SyncStrategy,
)

# ------------------------------------------------------------------ the strategy


class PipelineStrategy(SyncStrategy, CollectiveForward):
    """w_s <- w_s - lr * mean over the step's rows of dL/dw_s, stage s on its own worker."""

    name = Strategy.PIPELINE
    compiles = False  # its own build_module; training.compile refused
    pattern = Pattern.PIPELINE
    resizes = False
    shares_gradients = True

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        stage = cast(StageModule, ctx.module)
        self._groups = groups = stage.groups
        pipeline = ctx.config.pipeline
        self._microbatches = pipeline.microbatches
        training = ctx.config.training
        rows = groups.layout.stages * training.batch_size * training.accumulate_steps
        self._micro_rows = -(-rows // self._microbatches)  # every micro-batch the same size
        self._layers = StageLayers(stage, ctx.precision)
        self._kind = ScheduleGPipe if pipeline.pipeline_schedule is PipelineSchedule.GPIPE else Schedule1F1B
        self._schedule: ScheduleGPipe | Schedule1F1B | None = None  # built at the first step
        self._loss_fn: Callable[..., torch.Tensor] | None = None  # the loop's, learnt at the first step
        self._step_state: StepRows | None = None
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)  # the step's, x rows

    @classmethod
    def check_settings(cls, config: SparkDLConfig) -> None:
        world, pipeline = config.training.num_workers, config.pipeline
        stages = pipeline.stages or world
        if stages < 2:
            raise ConfigError(
                f"strategy = 'pipeline' needs at least 2 stages (pipeline.stages = {pipeline.stages}, "
                f"num_workers = {world}); with one worker per model use strategy = 'allreduce'"
            )
        if world % stages:
            raise ConfigError(
                f"num_workers = {world} is not a multiple of pipeline.stages = {stages}: each pipeline "
                f"needs all of its stages; set num_workers to {stages * max(1, world // stages)} or "
                "pipeline.stages to a divisor of it"
            )
        if pipeline.pipeline_schedule is PipelineSchedule.ONE_F_ONE_B and pipeline.microbatches < stages:
            raise ConfigError(
                f"pipeline.microbatches = {pipeline.microbatches} is below the {stages} stages, which "
                "pipeline_schedule = '1f1b' needs; raise microbatches (4 x stages keeps the idle share "
                "small) or use pipeline_schedule = 'gpipe'"
            )
        if pipeline.split_before and len(pipeline.split_before) != stages - 1:
            raise ConfigError(
                f"pipeline.split_before names {len(pipeline.split_before)} layers; {stages} stages need "
                f"{stages - 1} (the first layer of each stage after the first)"
            )
        data = config.data
        if (data.sequence_cols or data.tokenizer) and not data.pad_to_max_length:
            raise ConfigError(
                "strategy = 'pipeline' sends every micro-batch between its stages in one shape, which "
                "the stages agree on at the first step, but sequences are padded to each batch's longest "
                "row: set data.pad_to_max_length = true (with data.max_sequence_length)"
            )
        refuse_fp16(config, "its gradient scaler cannot see the stages' backwards")
        refuse_compression(config)
        refuse_hierarchy(config, "its replicas all-reduce one stage each")

    @classmethod
    def check_model(cls, module: nn.Module, config: SparkDLConfig) -> None:
        """On the driver, before any worker starts: the layers can be cut as set, and a
        Hugging Face decoder's layers compute what it does."""
        layers = checked_pipeline_layers(module, config.data.max_sequence_length)
        cls.cut(layers, config, config.training.num_workers)

    @classmethod
    def cut(cls, whole: nn.Module, config: SparkDLConfig, world: int) -> list[int]:
        """Where each stage starts, then the number of layers.

        Raises:
            ConfigError: the model is no ``nn.Sequential``, cannot be cut as set, or a stage
                would hold no trainable parameter.
        """
        whole = pipeline_layers(whole)
        stages = Layout.of(config, world).stages
        named = list(whole.named_children())
        names = [name for name, _ in named]
        costs = [sum(p.numel() for p in layer.parameters()) for _, layer in named]
        starts = [*stage_starts(names, costs, stages, config.pipeline.split_before), len(named)]
        for stage, (a, b) in enumerate(itertools.pairwise(starts)):
            if not any(p.requires_grad for _, layer in named[a:b] for p in layer.parameters()):
                raise ConfigError(
                    f"stage {stage + 1} of {stages} would hold only layers without trainable "
                    f"parameters ({', '.join(names[a:b])}); set pipeline.split_before to cut elsewhere "
                    f"(layers: {', '.join(names)}) or use fewer stages"
                )
        return starts

    @classmethod
    def build_module(
        cls,
        model_fn: Callable[[], nn.Module],
        config: SparkDLConfig,
        device: torch.device,
        parallelize_fn: Callable[[nn.Module, Any], object] | None = None,
    ) -> nn.Module:
        """This rank's stage on ``device``, and the pipeline's and the replicas' groups
        (:func:`~sparkdl.strategies.pipeline_stage.build_stage`: only rank 0 holds the whole
        model)."""
        return build_stage(model_fn, config, device, cls.cut)

    @classmethod
    def load_full_state(
        cls,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, torch.Tensor],
        optimizer_state: dict[str, Any],
    ) -> None:
        """Every rank holds the whole model's checkpoint; each keeps its stage's part."""
        stage = cast(StageModule, module)
        stage.load_state_dict({key: model_state[name] for key, name in stage.model_names.items()})
        named = indexed_to_named(optimizer_state, stage.whole_parameter_names)
        local = parameter_names(stage, optimizer)
        whole_name = {n: stage.aliases.get(n, n) for n in local}  # a tied copy: the tie's state
        members = [set(group["params"]) for group in named["param_groups"]]
        mine = {
            "state": {n: named["state"][w] for n, w in whole_name.items() if w in named["state"]},
            "param_groups": [
                {**group, "params": [n for n in local if whole_name[n] in member]}
                for group, member in zip(named["param_groups"], members, strict=True)
            ],
        }
        optimizer.load_state_dict(named_to_indexed(mine, local))

    # ---------------------------------------------------------------- the step

    def train_step(self, step: StepInput) -> StepOutcome:
        groups, ctx, stage = self._groups, self.ctx, cast(StageModule, self.ctx.module)
        if self._schedule is None:
            self._schedule = self._build_schedule(step)
        rows = join_batches(step.batches) if step.batches else step.filler().head(0)
        rows = rows.to(ctx.device)
        x = stage.one_input((), rows.inputs)
        counts = row_counts(len(rows), groups.pipeline, ctx.device)
        inputs = gather_rows(x, counts, groups.ranks[0], groups)
        labels = gather_rows(cast(torch.Tensor, rows.label), counts, groups.ranks[-1], groups)
        weights = (
            gather_rows(rows.weight, counts, groups.ranks[-1], groups) if rows.weight is not None else None
        )
        if not groups.first:  # what this worker sent of its rows (stage 0 keeps its inputs)
            self._layers.sent += x.nbytes
        if not groups.last:
            self._layers.sent += cast(torch.Tensor, rows.label).nbytes + (
                rows.weight.nbytes if rows.weight is not None else 0
            )
        self._loss_sum.zero_()
        self._step_state = StepRows(sum(counts), labels, weights, step.global_rows)
        if groups.first:
            padded = pad_rows(
                cast(torch.Tensor, inputs),
                self._micro_rows * self._microbatches,
                lambda: stage.one_input((), step.filler().inputs),
                ctx.device,
            )
            self._schedule.step(padded, return_outputs=False)
        elif groups.last:
            index = torch.arange(self._micro_rows * self._microbatches)  # on the CPU: no device sync to read
            self._schedule.step(target=index, return_outputs=False)
        else:
            self._schedule.step(return_outputs=False)
        self._step_state = None
        self._sum_tied()
        self._sum_over_replicas()
        self.stats.sync_rounds += 1
        self.stats.bytes_sent += self._layers.sent
        self._layers.sent = 0
        loss = self._agreed_loss(step.global_rows)
        return self._step_on_shared_gradients(step, loss)

    def _sum_tied(self) -> None:
        """Sum each tied parameter's gradient over the stages of this pipeline that hold its
        copies (a decoder's embedding and head): every copy then takes the same step, so they
        stay one tensor. A stage of the group without a copy of a tie adds zeros."""
        group, stage = self._groups.ties, cast(StageModule, self.ctx.module)
        if group is None:
            return
        holders = dist.get_world_size(group)
        device = self.ctx.device
        for tie, copy in zip(stage.ties, stage.tied_copies, strict=True):
            if not tie.trainable:
                continue
            grad = copy.grad if copy is not None else None
            summed = grad if grad is not None else torch.zeros(tie.shape, dtype=tie.dtype, device=device)
            dist.all_reduce(summed, group=group)
            if copy is not None and grad is None:
                copy.grad = summed
            self.stats.bytes_sent += 2 * (holders - 1) * summed.nbytes // holders

    def _sum_over_replicas(self) -> None:
        """Add up this stage's gradients over every pipeline (one all-reduce of them all,
        flattened): each pipeline's share is already scaled by its rows."""
        group = self._groups.replicas
        if group is not None:
            self.stats.bytes_sent += sum_gradients(self.ctx.module, group)

    def _build_schedule(self, step: StepInput) -> ScheduleGPipe | Schedule1F1B:
        """The first step, on every rank together: one row through the whole pipeline, in
        eval mode, with the loop's ``loss_of`` (which records the model's input and output
        shapes): each stage learns its input's and output's shapes and dtypes, and the
        schedule's stage is built with them (its static mode: torch's own shape inference
        would run a training-mode forward on uninitialised memory, into batch-norm
        statistics). The loss function ``loss_of`` calls serves the last stage."""
        if step.loss_fn is None:
            raise RuntimeError("strategy = 'pipeline' needs the step's loss function (StepInput.loss_fn)")
        self._loss_fn = step.loss_fn
        stage = cast(StageModule, self.ctx.module)
        row = (step.batches[0] if step.batches else step.filler()).head(1)
        training = stage.training
        stage.eval()
        try:
            with torch.no_grad(), self.ctx.precision.autocast():
                step.loss_of(stage, row)
        finally:
            stage.train(training)
        assert stage.seen is not None
        seen_in, seen_out = stage.seen
        stage.seen = None
        groups = self._groups

        def meta(seen: torch.Tensor, grad: bool) -> torch.Tensor:
            shape = (self._micro_rows, *seen.shape[1:])
            return torch.empty(shape, dtype=seen.dtype, device="meta", requires_grad=grad)

        pipeline_stage = PipelineStage(
            self._layers,
            groups.stage,
            groups.layout.stages,
            self.ctx.device,
            # a received activation carries a gradient back to the stage before; stage 0's rows do not
            input_args=meta(seen_in, grad=not groups.first),
            output_args=meta(seen_out, grad=True),
            group=groups.pipeline,
        )
        return self._kind(pipeline_stage, self._microbatches, loss_fn=self._micro_loss, scale_grads=False)

    def _micro_loss(self, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch (rows ``index`` of the step's padded
        rows), scaled so that the step's gradient is the mean over its real rows."""
        state = self._step_state
        assert state is not None and state.labels is not None and self._loss_fn is not None
        start = int(index[0])
        real = min(max(state.rows - start, 0), len(index))
        if real == 0:
            return output.sum() * 0.0  # padding only: the graph still reaches every parameter
        end = start + real
        weight = state.weights[start:end] if state.weights is not None else None
        loss = self._loss_fn(output[:real].float(), state.labels[start:end], weight)
        self._loss_sum.add_(loss.detach(), alpha=real)
        return loss * (real / state.global_rows)

    def _agreed_loss(self, global_rows: int) -> torch.Tensor:
        """The step's mean loss over every row, and a NaN where any rank saw a non-finite
        loss or gradient: one sum over the world, so every rank judges the step alike."""
        grads = [p.grad for p in self.ctx.module.parameters() if p.grad is not None]
        finite = bool(torch.isfinite(torch.stack([g.sum() for g in grads]).sum())) if grads else True
        total = float(self._loss_sum)
        figures = torch.tensor([total, 0.0 if finite else 1.0], dtype=torch.float64)
        dist.all_reduce(figures, group=self.ctx.control_group)
        total, non_finite = figures.tolist()
        value = float("nan") if non_finite or total != total else total / max(global_rows, 1)
        return torch.tensor(value, device=self.ctx.device)

    def _clip_gradients(self) -> None:
        """Clip by the norm of the whole model's gradient: each stage's share, summed over
        the pipeline."""
        stage = cast(StageModule, self.ctx.module)
        named = [(n, p.grad) for n, p in stage.named_parameters() if p.grad is not None]
        grads = [g for _, g in named]
        counted = [g for n, g in named if n not in stage.norm_skips]  # a tied copy counts once
        local = torch.stack([g.detach().float().pow(2).sum() for g in counted]).sum() if counted else None
        squared = torch.tensor([float(local) if local is not None else 0.0], dtype=torch.float64)
        dist.all_reduce(squared, group=self._groups.objects)
        norm = float(squared.sqrt())
        factor = self._clip_norm / (norm + 1e-6)
        if factor < 1:
            for g in grads:
                g.mul_(factor)

    def close(self) -> None:
        # the schedule holds this strategy's loss (a cycle): released now, with the stage
        # and its groups, not at some later garbage collection
        self._schedule = None

    # ---------------------------------------------------------------- the whole model

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The stages of pipeline 0, gathered to rank 0 (every rank calls it; the other
        pipelines hold the same weights and send nothing)."""
        stage = cast(StageModule, self.ctx.module)
        own = {stage.model_names[key]: value for key, value in cpu_state_dict(stage).items()}
        return self._gather_whole(own, lambda parts: merged_dicts(parts))

    def full_optimizer_state_dict(self) -> dict[str, Any]:
        stage = cast(StageModule, self.ctx.module)
        on_cpu = to_cpu(self.ctx.optimizer.state_dict())  # unpickled on rank 0: not on this GPU
        local = indexed_to_named(on_cpu, parameter_names(stage, self.ctx.optimizer))
        if stage.aliases:  # a tied copy's state is its first holder's (the same steps): once
            local = {
                "state": {n: v for n, v in local["state"].items() if n not in stage.aliases},
                "param_groups": [
                    {**g, "params": [n for n in g["params"] if n not in stage.aliases]}
                    for g in local["param_groups"]
                ],
            }
        return self._gather_whole(
            local, lambda parts: merged_optimizer_states(parts, stage.whole_parameter_names)
        )

    def _gather_whole(self, part: Any, merge: Callable[[list[Any]], Any]) -> Any:
        """Every stage's ``part`` of pipeline 0 (nested dicts and lists of tensors), merged on
        rank 0 (``{}`` elsewhere). The structures travel pickled without their tensors, then
        each tensor on its own into its final place on rank 0: no rank holds a pickled copy
        of a stage (gather_object held the bytes and the tensors: +4.7 GB on rank 0 for a
        1B-parameter model's second stage)."""
        groups = self._groups
        if groups.layout.replica_of(groups.rank) != 0:
            return {}
        tensors: list[torch.Tensor] = []
        skeleton = without_tensors(part, tensors)
        skeletons: list[Any] | None = [None] * groups.layout.stages if groups.rank == 0 else None
        dist.gather_object(skeleton, skeletons, dst=0, group=groups.objects)
        if groups.rank != 0:
            for tensor in tensors:
                dist.send(tensor.detach().cpu().contiguous(), dst=0, group=groups.objects)
            return {}
        assert skeletons is not None
        parts = [part]
        for stage, received in enumerate(skeletons[1:], start=1):
            take = functools.partial(received_tensor, src=groups.ranks[stage], groups=groups)
            parts.append(with_tensors(received, take))
        return merge(parts)

    def load_state_from_rank0(self, state: dict[str, torch.Tensor]) -> None:
        """Rank 0's whole state: each stage of pipeline 0 gets its part, then every
        pipeline takes its stage's from pipeline 0."""
        groups, stage = self._groups, self.ctx.module
        if groups.layout.replica_of(groups.rank) == 0:
            keys: list[Any] | None = [None] * groups.layout.stages if groups.rank == 0 else None
            names = cast(StageModule, stage).model_names
            dist.gather_object(list(names.values()), keys, dst=0, group=groups.objects)
            parts = None
            if keys is not None:
                parts = [{name: state[name] for name in part} for part in keys]
            received: list[Any] = [None]
            dist.scatter_object_list(received, parts, src=0, group=groups.objects)
            stage.load_state_dict({key: received[0][name] for key, name in names.items()})
        if groups.replicas is not None:
            with torch.no_grad():
                for tensor in [*stage.parameters(), *stage.buffers()]:
                    dist.broadcast(tensor, src=groups.layout.stage_of(groups.rank), group=groups.replicas)
