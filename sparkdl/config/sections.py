"""The sections of the library's settings: one frozen dataclass per ``[section]``.

Every field says what it means and which values are valid (``metadata=about(...)``);
:mod:`sparkdl.config.table` builds the settings table from them. Rules about one section live
in its ``__post_init__``; rules across sections in :class:`sparkdl.config.SparkDLConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkdl.config.choices import (
    DEFAULT_LOSS,
    DRILL_FORM,
    LOSS_NAMES,
    Backend,
    Compression,
    FaultDrillSpec,
    Hierarchy,
    LrSchedule,
    OnError,
    OptimizerName,
    Precision,
    PsMode,
    Strategy,
    UseGpu,
)
from sparkdl.config.loading import about, check_bounds
from sparkdl.errors import ConfigError


@dataclass(frozen=True)
class TrainingConfig:
    """``[training]``: what to train and for how long."""

    num_workers: int = field(
        default=2,
        metadata=about(
            "Barrier tasks that train at once, one model replica each (needs that many slots).", bound="> 0"
        ),
    )
    batch_size: int = field(
        default=64,
        metadata=about(
            "Rows per optimizer step on each worker; a step sees batch_size x num_workers.", bound="> 0"
        ),
    )
    epochs: int = field(default=5, metadata=about("Passes over the training rows.", bound="> 0"))
    seed: int = field(
        default=0, metadata=about("Seeds the initial weights, the shuffle and the jobs' train/test split.")
    )
    strategy: Strategy = field(
        default=Strategy.ALLREDUCE,
        metadata=about(
            "How workers keep their models in sync: all-reduce gradients every step, average weights "
            "([weight_averaging]), push gradients to a server on the driver ([parameter_server]), or "
            "shard parameters, gradients and optimizer state across the workers (fsdp: PyTorch FSDP2)."
        ),
    )
    shuffle: bool = field(
        default=True,
        metadata=about("Reshuffle each worker's rows every epoch (seeded); false keeps their order."),
    )
    loss: str = field(
        default=DEFAULT_LOSS,
        metadata=about(
            "The loss by name, used when TorchEstimator gets no loss_fn; "
            "set both only if they name the same loss.",
            valid="one of " + ", ".join(LOSS_NAMES),
        ),
    )

    accumulate_steps: int = field(
        default=1,
        metadata=about(
            "Local batches whose gradients add up before one optimizer step (a step then sees "
            "batch_size x accumulate_steps rows per worker, in the memory of one batch).",
            bound="> 0",
        ),
    )
    validation_fraction: float = field(
        default=0.0,
        metadata=about(
            "Share of the rows held out (seeded) to measure val_loss and val_accuracy or val_rmse "
            "after every epoch, on the executors; 0 = none.",
            valid="0 <= value < 1",
        ),
    )
    validation_col: str = field(
        default="",
        metadata=about('A boolean column: its true rows validate instead of training; "" = none.'),
    )
    early_stopping_patience: int = field(
        default=0,
        metadata=about(
            "Stop after this many epochs without a lower val_loss and keep the best epoch's weights; "
            "0 = train every epoch.",
            bound=">= 0",
        ),
    )
    precision: Precision = field(
        default=Precision.FP32,
        metadata=about(
            "Autocast dtype of forward and loss: bf16 (CPU and GPU) or fp16 (with a gradient scaler; "
            "not with the parameter server); weights and optimizer state stay float32."
        ),
    )

    def __post_init__(self) -> None:
        check_bounds(self, "training")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ConfigError(
                f"training.validation_fraction = {self.validation_fraction} must be >= 0 and < 1"
            )
        if self.validation_fraction and self.validation_col:
            raise ConfigError(
                f"validation_fraction = {self.validation_fraction} and validation_col = "
                f"{self.validation_col!r} both choose validation rows; set one"
            )
        if self.loss not in LOSS_NAMES:
            raise ConfigError(
                f"training.loss = {self.loss!r} is not a known loss; choose one of "
                f"{', '.join(LOSS_NAMES)}, or pass a callable loss_fn to TorchEstimator"
            )


@dataclass(frozen=True)
class OptimizerConfig:
    """``[optimizer]``: used when no ``optimizer_fn`` is given."""

    optimizer: OptimizerName = field(
        default=OptimizerName.SGD,
        metadata=about(
            "The optimizer built from this section when TorchEstimator gets no optimizer_fn "
            "(adam and adamw use PyTorch's fused kernel on a GPU, except under fsdp)."
        ),
    )
    lr: float = field(default=0.1, metadata=about("Learning rate of that optimizer.", bound="> 0"))
    momentum: float = field(
        default=0.0, metadata=about("Momentum of sgd (the other optimizers ignore it).", bound=">= 0")
    )
    weight_decay: float = field(
        default=0.0, metadata=about("Weight decay of that optimizer (decoupled for adamw).", bound=">= 0")
    )

    lr_schedule: LrSchedule = field(
        default=LrSchedule.CONSTANT,
        metadata=about(
            "How lr changes: constant (after any warm-up), warm-up then cosine or linear decay to 0 "
            "over the run, or step (times lr_gamma at each epoch in lr_milestones)."
        ),
    )
    warmup_steps: int = field(
        default=0,
        metadata=about("Optimizer steps over which lr rises linearly to its peak.", bound=">= 0"),
    )
    lr_milestones: tuple[int, ...] = field(
        default=(),
        metadata=about("Epochs (1-based) at whose start a step schedule multiplies lr by lr_gamma."),
    )
    lr_gamma: float = field(
        default=0.1, metadata=about("A step schedule's factor per milestone.", bound="> 0")
    )
    scale_lr: bool = field(
        default=False,
        metadata=about(
            "The large-batch rule: peak lr = lr x num_workers, reached by a linear warm-up from lr "
            "over warmup_steps (Goyal et al.)."
        ),
    )
    grad_clip_norm: float = field(
        default=0.0,
        metadata=about(
            "Clip the gradient's global L2 norm to this before each step (the parameter server clips "
            "each worker's gradient before it is pushed); 0 = off.",
            bound=">= 0",
        ),
    )

    def __post_init__(self) -> None:
        check_bounds(self, "optimizer")


@dataclass(frozen=True)
class DataConfig:
    """``[data]``: which columns feed the model and how batches are fed."""

    feature_cols: tuple[str, ...] = field(
        default=("features",),
        metadata=about(
            "Columns fed to the model, in order (numbers, arrays or ML vectors), "
            "joined into one float32 row.",
            valid="one or more column names, none of them label_col",
        ),
    )
    label_col: str = field(
        default="label",
        metadata=about(
            "Column of the target: a class index for cross_entropy, numbers for the other losses.",
            valid="a column name not in feature_cols",
        ),
    )
    inputs: dict[str, str | tuple[str, ...]] = field(
        default_factory=dict,
        metadata=about(
            "Named model inputs, the model called as model(**inputs): name -> one column (kept in its "
            "own type and shape: integers int64, numbers, arrays, nested arrays, ml Vectors float32, "
            "images CHW) or a list of columns (one float32 matrix). Empty: feature_cols feed model(x).",
            valid='a table, e.g. {user = "user_id", dense = ["age", "income"]}',
        ),
    )
    input_shapes: dict[str, tuple[int, ...]] = field(
        default_factory=dict,
        metadata=about(
            "Per-row shape of single-column inputs whose arrays hold a flattened tensor.",
            valid="a table of input name -> list of ints, e.g. {image = [1, 28, 28]}",
        ),
    )
    sequence_cols: tuple[str, ...] = field(
        default=(),
        metadata=about(
            "Array columns whose rows differ in length (token ids): padded per batch to the longest "
            "row, with a boolean <input>_mask input.",
            valid="columns that are single-column inputs",
        ),
    )
    max_sequence_length: int = field(
        default=0,
        metadata=about("Longer sequences keep their first values; 0 = no cap.", bound=">= 0"),
    )
    weight_col: str = field(
        default="",
        metadata=about(
            "Column of per-row loss weights (finite, >= 0): the loss is the mean of weight x row loss; "
            '"" = every row weighs 1.'
        ),
    )
    cache_transformed: bool = field(
        default=False,
        metadata=about(
            "Cache transform_fn's output after epoch 1 instead of running it on the raw rows every "
            "epoch (faster; no fresh random augmentation)."
        ),
    )
    prediction_col: str = field(
        default="prediction", metadata=about("Column that TorchModel.transform adds with the model's output.")
    )
    raw_prediction_col: str = field(
        default="rawPrediction",
        metadata=about(
            "Vector column of a classifier's raw outputs (for one logit z: [-z, z]) that transform adds.",
            valid='a column name, or "" to leave it out',
        ),
    )
    probability_col: str = field(
        default="probability",
        metadata=about(
            "Vector column of a classifier's class probabilities (softmax, or sigmoid for one logit) "
            "that transform adds.",
            valid='a column name, or "" to leave it out',
        ),
    )
    cache_dir: str = field(
        default="",
        metadata=about(
            "Where each worker caches its decoded rows after epoch 1, so later epochs skip the Spark "
            'query; "" = the executor\'s first local dir.',
            valid='a local directory on every executor, or ""',
        ),
    )
    cache_memory_mb: int = field(
        default=256,
        metadata=about(
            "A worker keeps its decoded partition in memory when it is at most this large (epoch 1 "
            "then writes nothing; the held-out validation rows have a budget of their own); a larger "
            "one is cached on local disk (cache_dir). 0 = always on disk.",
            bound=">= 0",
        ),
    )
    cache_memory_keep_s: float = field(
        default=60.0,
        metadata=about(
            "Seconds a Python worker keeps the pages of its closed in-memory cache for the next "
            "fit's to reuse (Spark reuses Python workers task after task; the kernel zeroes fresh "
            "pages, 0.8 s of system time a GB on the benchmarks' VM). The worker holds at most 2x "
            "cache_memory_mb meanwhile, which a fit with other data sizes does not reuse. 0 = this "
            "fit's cache keeps nothing (pages an earlier fit left still go after that fit's time); "
            "set 0 where spark.executor.pyspark.memory leaves no room for them.",
            bound=">= 0",
        ),
    )
    prefetch_batches: int = field(
        default=4,
        metadata=about(
            "Batches a background thread prepares ahead of the training step; 0 = none.", bound=">= 0"
        ),
    )
    inference_batch_size: int = field(
        default=1024, metadata=about("Rows per forward pass in TorchModel.transform.", bound="> 0")
    )

    def __post_init__(self) -> None:
        if not self.feature_cols and not self.inputs:
            raise ConfigError("data.feature_cols is empty; name at least one feature column (or set inputs)")
        if not self.inputs and self.label_col in self.feature_cols:
            raise ConfigError(
                f"data.label_col = {self.label_col!r} is also a feature column; "
                "a model must not see its own label"
            )
        check_bounds(self, "data")


@dataclass(frozen=True)
class RuntimeConfig:
    """``[runtime]``: devices, process group and the timeouts of every wait."""

    backend: Backend = field(
        default=Backend.AUTO,
        metadata=about("torch.distributed backend of the workers; auto is nccl on GPU and gloo on CPU."),
    )
    use_gpu: UseGpu = field(
        default=UseGpu.AUTO,
        metadata=about(
            "Train on GPU: true fails fast without one, false stays on CPU, "
            "auto uses the GPU Spark gave the task."
        ),
    )
    collective_timeout_s: float = field(
        default=300.0,
        metadata=about(
            "Longest a worker waits in the rendezvous or a collective before failing.", bound="> 0"
        ),
    )
    executor_wait_timeout_s: float = field(
        default=30.0,
        metadata=about(
            "How long fit waits for enough free task slots (executors still starting).", bound=">= 0"
        ),
    )
    torch_threads: int = field(
        default=0, metadata=about("torch intra-op threads per worker; 0 = spark.task.cpus.", bound=">= 0")
    )
    network_interface: str = field(
        default="",
        metadata=about(
            "Network interface of the process group (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME); "
            '"" lets torch choose.',
            valid='an interface name such as "eth0", or ""',
        ),
    )
    compression: Compression = field(
        default=Compression.NONE,
        metadata=about(
            "What the strategies compress before it travels: allreduce its gradients (a DDP hook), "
            "weight_averaging the change since the last average, parameter_server its pushes. fp16 and "
            "bf16 halve the bytes; 1bit sends signs and two means per 1,024 values (1/30 of float32); topk "
            "the topk_ratio largest values; 1bit and topk carry what they lose into the next round (error "
            "feedback). powersgd is PyTorch's low-rank hook (allreduce only)."
        ),
    )
    topk_ratio: float = field(
        default=0.01,
        metadata=about("The share of values compression = 'topk' sends, at most 1.", bound="> 0"),
    )
    error_feedback: bool = field(
        default=True,
        metadata=about(
            "Carry what 1bit and topk compression lost into the next round; turn off only to see what "
            "it is worth (1bit then loses accuracy)."
        ),
    )
    powersgd_rank: int = field(
        default=2, metadata=about("Rank of PowerSGD's low-rank approximation.", bound="> 0")
    )
    hierarchy: Hierarchy = field(
        default=Hierarchy.NONE,
        metadata=about(
            "Aggregate within a host first: its workers reduce into one leader, the leaders exchange "
            "across hosts, and each hands the result back (parameter_server: only the leaders push and "
            "pull). host groups the tasks by address, executor by executor; none = flat."
        ),
    )
    shared_memory: bool = field(
        default=True,
        metadata=about(
            "On CPUs, when every worker runs on one host (local mode, one machine's executors), allreduce "
            "and weight_averaging exchange through a shared-memory segment instead of gloo's loopback TCP "
            "(the same sums, the same on every worker; not with compression); with a hierarchy, each "
            "host's level does, every strategy. Falls back to gloo, with a warning, where /dev/shm "
            "cannot hold it."
        ),
    )
    bucket_cap_mb: float = field(
        default=25.0,
        metadata=about(
            "Size of the buckets gradients (allreduce) or weights (weight_averaging) travel in.", bound="> 0"
        ),
    )
    teardown_timeout_s: float = field(
        default=60.0,
        metadata=about(
            "How long a worker may take to release its process groups, sockets and threads after the "
            "last step before it is ended with a clear error.",
            bound="> 0",
        ),
    )
    preflight: bool = field(
        default=True,
        metadata=about(
            "Before the training stage, check on the driver that a few rows go through model_fn, the "
            "loss and one backward (fails in seconds, once, in the terms of the columns), and that the "
            "executors' Python can import torch and sparkdl; turn off for a model too big for the driver."
        ),
    )
    progress: bool = field(
        default=True,
        metadata=about("Live progress bars on the driver (worker warnings are forwarded either way)."),
    )
    progress_interval_s: float = field(
        default=0.5, metadata=about("Shortest time between two progress reports of a worker.", bound="> 0")
    )
    encrypt: bool = field(
        default=False,
        metadata=about(
            "Encrypt the driver's sockets (parameter server, progress, weights) with AES-256-GCM under "
            "per-connection keys; frames are authenticated either way. Traffic between workers (gloo, "
            "NCCL) is not covered: see docs/guide/security.md."
        ),
    )

    def __post_init__(self) -> None:
        check_bounds(self, "runtime")
        if self.topk_ratio > 1:
            raise ConfigError(
                f"runtime.topk_ratio = {self.topk_ratio} must be at most 1 (the share of values sent)"
            )
        if self.backend is Backend.NCCL and self.use_gpu is UseGpu.NO:
            raise ConfigError(
                "runtime.backend = 'nccl' needs GPUs but runtime.use_gpu = false; "
                "set backend = 'gloo' or 'auto', or use_gpu = 'auto'"
            )


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

    def __post_init__(self) -> None:
        check_bounds(self, "weight_averaging")


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
class ReliabilityConfig:
    """``[reliability]``: checkpoints, resume, and what to do about bad input."""

    checkpoint_dir: str = field(
        default="",
        metadata=about(
            'Directory of the checkpoints a rerun of fit resumes from; "" = no checkpoints.',
            valid='a directory every executor and the driver can reach, or ""',
        ),
    )
    checkpoint_every: int = field(
        default=0,
        metadata=about(
            "Optimizer steps between checkpoints; 0 = at epoch ends only (with checkpoint_dir).", bound=">= 0"
        ),
    )
    on_bad_rows: OnError = field(
        default=OnError.ERROR,
        metadata=about(
            "Rows with nulls, NaN, wrong lengths or bad labels: stop the fit, or skip and count them."
        ),
    )
    on_nan_loss: OnError = field(
        default=OnError.ERROR,
        metadata=about("A non-finite loss: stop the fit, or skip that step and count it (on every rank)."),
    )
    max_nan_skips: int = field(
        default=10,
        metadata=about("With on_nan_loss = skip: stop after this many skipped steps in a row.", bound=">= 0"),
    )
    fault_injection: str = field(
        default="",
        metadata=about(
            'A fault drill, fired once on one rank at one step; "" = none.', valid=f'"" or {DRILL_FORM}'
        ),
    )

    def __post_init__(self) -> None:
        check_bounds(self, "reliability")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError(
                f"reliability.checkpoint_every = {self.checkpoint_every} but no checkpoint_dir is set; "
                "set checkpoint_dir to a directory every executor and the driver can reach"
            )
        if self.fault_injection:
            FaultDrillSpec.parse(self.fault_injection)

    @property
    def drill(self) -> FaultDrillSpec | None:
        """The fault drill named by ``fault_injection``, or None when there is none."""
        return FaultDrillSpec.parse(self.fault_injection) if self.fault_injection else None


@dataclass(frozen=True)
class TrackingConfig:
    """``[tracking]``: MLflow logging (needs the ``mlflow`` extra and a tracking URI)."""

    mlflow: bool = field(
        default=True,
        metadata=about("Log the fit to MLflow when mlflow is installed and a tracking URI is set."),
    )
    mlflow_experiment: str = field(
        default="", metadata=about('MLflow experiment to log to; "" = the active or default one.')
    )
    mlflow_run_name: str = field(default="", metadata=about('Name of the MLflow run; "" lets MLflow choose.'))
    mlflow_log_model: bool = field(
        default=True, metadata=about("Log the trained model to the run (mlflow.pytorch).")
    )
    mlflow_pickle_model: bool = field(
        default=False,
        metadata=about(
            "Log a model that does not export as pt2 pickled (loading a pickle runs its code); "
            "off: only its weights are logged, as a weights_only torch file."
        ),
    )
