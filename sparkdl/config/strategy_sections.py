"""The sections that one strategy reads: ``[weight_averaging]``, ``[parameter_server]``, ``[pipeline]``
and ``[tensor]``.

Each is read only when ``training.strategy`` names its strategy (local SGD, or a parameter
server on the driver), so they sit apart from the sections every fit uses. Each is one frozen
dataclass whose fields carry their meaning and valid values (``metadata=about(...)``); rules
within a section live in its ``__post_init__``; rules that involve ``[training]`` or
``[runtime]`` (backup workers against num_workers, a hierarchy) live with the strategy
(``check_settings`` of its class in :mod:`sparkdl.strategies`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkdl.config.choices import OuterOptimizer, PipelineBalance, PipelineSchedule, Precision, PsMode
from sparkdl.config.loading import about, check_bounds
from sparkdl.errors import ConfigError


@dataclass(frozen=True)
class WeightAveragingConfig:
    """``[weight_averaging]``: local steps, then an average of the weights (local SGD)."""

    sync_every: int = field(
        default=8,
        metadata=about("Local optimizer steps between two averages of the weights (tau).", bound="> 0"),
    )
    average_optimizer_state: bool = field(
        default=True,
        metadata=about(
            "Average the optimizer state (momentum, Adam moments) too; false keeps it per worker."
        ),
    )
    wa_backup_workers: int = field(
        default=0,
        metadata=about(
            "End each period of sync_every local steps once num_workers - wa_backup_workers workers "
            "finished it; a worker still behind trains none of the period's remaining steps (it counts "
            "them as skipped_steps) and joins the average weighted by the rows it did train (from "
            "epoch 2: the first epoch streams in lockstep).",
            bound=">= 0",
        ),
    )
    outer_optimizer: OuterOptimizer = field(
        default=OuterOptimizer.NONE,
        metadata=about(
            "none: each round's average is the new model. nesterov (DiLoCo): the round's average change "
            "of the weights is a pseudo-gradient, applied with Nesterov momentum (outer_lr, "
            "outer_momentum), which lets sync_every grow to hundreds of steps."
        ),
    )
    outer_lr: float = field(
        default=0.7,
        metadata=about(
            "Outer learning rate (nesterov); 1 with outer_momentum = 0 is plain averaging.", bound="> 0"
        ),
    )
    outer_momentum: float = field(
        default=0.9, metadata=about("Outer Nesterov momentum (nesterov), below 1.", bound=">= 0")
    )
    fragments: int = field(
        default=1,
        metadata=about(
            "Streaming DiLoCo: cut the parameters into this many fragments of about equal bytes, each "
            "averaged every sync_every steps at its own offset, so one fragment crosses the network at "
            "a time; the whole model is still averaged at epoch ends and checkpoints (plainly; the "
            "fragments' next rounds pass what came before through the outer optimizer). 1: the whole "
            "model every sync_every steps.",
            bound="> 0",
        ),
    )
    fragment_delay: int = field(
        default=0,
        metadata=about(
            "fragments > 1: steps a fragment's sum travels while training goes on before it is "
            "applied (overlap; below sync_every).",
            bound=">= 0",
        ),
    )
    fragment_mix: float = field(
        default=0.0,
        metadata=about(
            "fragments > 1: at a fragment's arrival, the share of the worker's own weights kept "
            "(new = mix * own + (1 - mix) * global; Streaming DiLoCo's alpha), from 0 to below 1.",
            bound=">= 0",
        ),
    )

    def __post_init__(self) -> None:
        check_bounds(self, "weight_averaging")
        if self.outer_momentum >= 1:
            raise ConfigError(
                f"weight_averaging.outer_momentum = {self.outer_momentum} must be below 1 (DiLoCo uses 0.9)"
            )
        if self.fragments > self.sync_every:
            raise ConfigError(
                f"weight_averaging.fragments = {self.fragments} is more than sync_every = {self.sync_every}: "
                "fragments take turns within each sync_every steps; use at most sync_every fragments"
            )
        if self.fragment_delay >= self.sync_every:
            raise ConfigError(
                f"weight_averaging.fragment_delay = {self.fragment_delay} must be below sync_every = "
                f"{self.sync_every}: a fragment's sum must arrive before its next round is sent"
            )
        if self.fragment_mix >= 1:
            raise ConfigError(
                f"weight_averaging.fragment_mix = {self.fragment_mix} must be below 1 (1 would never take "
                "the average); Streaming DiLoCo's runs use 0.5 with a delay, 0 without"
            )


@dataclass(frozen=True)
class ParameterServerConfig:
    """``[parameter_server]``: the server on the driver and how workers talk to it."""

    ps_mode: PsMode = field(
        default=PsMode.SYNC,
        metadata=about(
            "sync waits for every worker each step, ssp lets a worker run up to staleness clocks ahead, "
            "async applies each push as it arrives (Downpour)."
        ),
    )
    staleness: int = field(
        default=2,
        metadata=about("ssp: clocks a worker may run ahead of the slowest; 0 = sync.", bound=">= 0"),
    )
    push_every: int = field(
        default=1, metadata=about("async: steps whose gradients a worker sums before one push.", bound="> 0")
    )
    pull_every: int = field(
        default=1, metadata=about("async: steps between two fetches of fresh weights.", bound="> 0")
    )
    backup_workers: int = field(
        default=0,
        metadata=about(
            "sync: apply each step once num_workers - backup_workers workers pushed it; a late push is "
            "dropped and counted, and a worker that fell behind skips ahead (from epoch 2: the first "
            "epoch streams in lockstep).",
            bound=">= 0",
        ),
    )
    ps_barrier: bool = field(
        default=True,
        metadata=about(
            "false (ps_mode = 'async' or 'ssp', whose staleness then counts only the tasks alive): "
            "every worker is an ordinary Spark task, not one of a "
            "barrier stage: a worker that fails is retried by Spark alone (spark.task.maxFailures) and "
            "resumes from the server's weights, skipping the rows its predecessor's pushes hold, while "
            "the others train on (no validation or hierarchy; one shard; with checkpoint_dir the driver "
            "snapshots the server there, and a new fit resumes from it)."
        ),
    )

    @property
    def push_interval(self) -> int:
        """A worker's steps between two pushes: ``push_every`` in async, every step otherwise."""
        return self.push_every if self.ps_mode is PsMode.ASYNC else 1

    ps_timeout_s: float = field(
        default=120.0,
        metadata=about(
            "Longest a pull waits for other workers before failing with their ranks.", bound="> 0"
        ),
    )
    ps_shards: int = field(
        default=0,
        metadata=about(
            "Shards of the parameters, each served on its own connection and thread; 0 = one per 16 MB "
            "of parameters, at most 4 (one for a small model: each shard is a round trip per step).",
            bound=">= 0",
        ),
    )
    ps_torch_threads: int = field(
        default=1,
        metadata=about(
            "torch intra-op threads on the driver while the server runs (restored after fit; 0 = "
            "leave them): shards already run in parallel, and an idle OpenMP pool spins on cores "
            "the executors may share in local mode.",
            bound=">= 0",
        ),
    )
    ps_max_frame_mb: float = field(
        default=1024.0,
        metadata=about(
            "Largest frame the server or a worker accepts; raise it for a bigger shard.", bound="> 0"
        ),
    )
    ps_pull_precision: Precision = field(
        default=Precision.FP32,
        metadata=about(
            "Weights a pull carries: fp32, or bf16 (half the bytes of the server's busiest direction; "
            "workers compute on weights rounded to bf16, the server keeps and returns float32).",
            valid="fp32, bf16",
        ),
    )
    ps_shared_memory_mb: float = field(
        default=512.0,
        metadata=about(
            "Workers on the driver's own host (local mode, a single-node cluster) push and pull "
            "through shared memory instead of a loopback socket (only the authenticated headers "
            "cross it): at most this many MB of it, an area per connection while they last, "
            "touched only as used; 0 = sockets only. Off with runtime.shared_memory = false.",
            bound=">= 0",
        ),
    )

    def __post_init__(self) -> None:
        check_bounds(self, "parameter_server")
        if self.ps_pull_precision is Precision.FP16:
            raise ConfigError(
                "ps_pull_precision = 'fp16' could overflow weights above 65504; use 'bf16' (the same "
                "bytes, float32's range) or 'fp32'"
            )


@dataclass(frozen=True)
class PipelineConfig:
    """``[pipeline]``: the model cut into stages, one per worker, fed micro-batches."""

    stages: int = field(
        default=0,
        metadata=about(
            "Stages the model is cut into, each on its own worker; num_workers / stages pipelines then "
            "train as data-parallel replicas (their gradients all-reduced every step). 0: one pipeline "
            "over every worker.",
            bound=">= 0",
        ),
    )
    microbatches: int = field(
        default=8,
        metadata=about(
            "Micro-batches each pipeline's step is cut into (its rows: batch_size x accumulate_steps from "
            "each of its workers); the idle share of a GPipe step is (stages - 1) / (microbatches + "
            "stages - 1).",
            bound="> 0",
        ),
    )
    pipeline_schedule: PipelineSchedule = field(
        default=PipelineSchedule.ONE_F_ONE_B,
        metadata=about(
            "gpipe: every micro-batch's forward, then every backward (activations of all micro-batches "
            "held). 1f1b: one forward, one backward in the steady state (at most stages of them held)."
        ),
    )
    split_before: tuple[str, ...] = field(
        default=(),
        metadata=about(
            "Names of the model's top-level layers (its nn.Sequential children) that begin stages 2, 3, "
            "...; empty: cut automatically, as pipeline_balance says.",
            valid="stages - 1 layer names, in the model's order",
        ),
    )
    pipeline_balance: PipelineBalance = field(
        default=PipelineBalance.PARAMETERS,
        metadata=about(
            "The automatic cut (no split_before): parameters gives each stage about the same number of "
            "parameters (memory); time about the same forward + backward time, each layer timed on the "
            "driver on a micro-batch of the first rows before training (on its device: a CPU driver "
            "ranks a GPU cluster's layers as a CPU runs them)."
        ),
    )

    def __post_init__(self) -> None:
        check_bounds(self, "pipeline")


@dataclass(frozen=True)
class TensorConfig:
    """``[tensor]``: large linear layers split across the workers of a group (Megatron's MLP)."""

    tp_size: int = field(
        default=0,
        metadata=about(
            "Workers each pair of linear layers is split over (the first by columns, the second by rows); "
            "num_workers / tp_size groups then train as data-parallel replicas (their gradients "
            "all-reduced every step). 0: one group of every worker.",
            bound=">= 0",
        ),
    )
    tensor_plan: tuple[str, ...] = field(
        default=(),
        metadata=about(
            "Your own split, for models the built-in plan cannot read (layers outside an nn.Sequential): "
            "'name:columns' for an nn.Linear split by its outputs, 'name:rows' for one split by its inputs "
            "(after a columns layer: one all-reduce sums the partial outputs), 'name:vocabulary' for an "
            "nn.Embedding. Empty: Megatron's pairs inside every nn.Sequential, and every embedding.",
            valid="'module.name:columns|rows|vocabulary' entries",
        ),
    )

    def __post_init__(self) -> None:
        check_bounds(self, "tensor")
