"""The sections of what is learned: ``[training]``, ``[optimizer]`` and ``[data]``.

These three say what a fit trains, for how long, from which columns and with which optimizer,
whatever the strategy or the cluster: they are the settings a user changes most, and the ones
``TorchEstimator``'s own arguments (``loss_fn``, ``optimizer_fn``) stand in for. Each is one
frozen dataclass whose fields carry their meaning and valid values (``metadata=about(...)``);
rules within a section live in its ``__post_init__``, rules across sections in
:class:`sparkdl.config.SparkDLConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkdl.config.choices import (
    DEFAULT_LOSS,
    LOSS_NAMES,
    LbfgsObjective,
    LrSchedule,
    OptimizerName,
    Precision,
    Strategy,
)
from sparkdl.config.loading import about, check_bounds, check_local_directory
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
            "shard parameters, gradients and optimizer state across the workers (fsdp: PyTorch FSDP2), or "
            "cut the model into stages, one per worker, fed micro-batches (pipeline: [pipeline]), or split "
            "its large linear layers across the workers (tensor: [tensor], PyTorch's DTensor)."
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
    activation_checkpointing: bool = field(
        default=False,
        metadata=about(
            "Keep only each layer's input through forward and recompute the rest in backward (the "
            "model's top-level layers with parameters): less memory for activations, about one more "
            "forward of compute. Every strategy."
        ),
    )
    compile: bool = field(
        default=False,
        metadata=about(
            "Run torch.compile on each worker's model (in place: the same weights and names) and on "
            "transform's; the first step compiles, its seconds are compile_s in epoch 1's history. "
            "allreduce, weight_averaging and parameter_server. Off: on small models and CPUs the "
            "compile costs more than it saves (benchmarks/bench_compile.py)."
        ),
    )
    compile_backend: str = field(
        default="inductor",
        metadata=about(
            "The torch.compile backend with compile = true: inductor generates fused code; eager and "
            "aot_eager only trace (cheap to compile, for checking a model compiles).",
            valid="a name torch._dynamo.list_backends() gives",
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
            "(adam and adamw use PyTorch's fused kernel on a GPU, except under fsdp); lbfgs trains "
            "full-batch instead of in steps ([lbfgs]; set lr = 1)."
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
class LbfgsConfig:
    """``[lbfgs]``: the full-batch optimizer of ``optimizer = "lbfgs"`` (Sandblaster L-BFGS):
    every iteration a pass over every worker's rows, its step found by a line search that
    costs passes too. PyTorch's ``torch.optim.LBFGS`` settings, by the same names."""

    max_iterations: int = field(
        default=100,
        metadata=about("Iterations at most (they replace epochs: each takes one pass or more).", bound="> 0"),
    )
    max_evaluations: int = field(
        default=0,
        metadata=about(
            "Passes over the data at most, the line searches' included; 0 = max_iterations x 5 / 4.",
            bound=">= 0",
        ),
    )
    history_size: int = field(
        default=10,
        metadata=about(
            "Correction pairs kept (each two vectors of the model's size, on every worker with "
            "allreduce, on the parameter server's shards with parameter_server).",
            bound="> 0",
        ),
    )
    line_search: bool = field(
        default=True,
        metadata=about("Strong Wolfe line search (true), or a fixed step of lr along the direction (false)."),
    )
    tolerance_grad: float = field(
        default=1e-7,
        metadata=about("Stop once no gradient entry exceeds this in magnitude.", bound=">= 0"),
    )
    tolerance_change: float = field(
        default=1e-9,
        metadata=about("Stop once the loss or the step changes by less than this.", bound=">= 0"),
    )
    objective: LbfgsObjective = field(
        default=LbfgsObjective.MEAN,
        metadata=about(
            "What it minimizes: mean (the mean loss over every row, a weight column's products over "
            "the row count, plus weight_decay / 2 x |w|^2 on every weight: torch.optim.LBFGS's "
            "objective on the whole data) or spark (Spark ML's LogisticRegression's: a weight "
            "column's products over the weights' sum, and no decay on biases, the intercepts; "
            "allreduce only)."
        ),
    )

    def __post_init__(self) -> None:
        check_bounds(self, "lbfgs")


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
            "row, with a boolean mask input named by mask_input.",
            valid="columns that are single-column inputs",
        ),
    )
    mask_input: str = field(
        default="{name}_mask",
        metadata=about(
            "The name a sequence input's mask reaches the model under: {name} is the input's name. "
            'Hugging Face models take "attention_mask" (then one sequence input).',
            valid='a keyword argument name, with {name} where the input\'s name goes, e.g. "attention_mask"',
        ),
    )
    max_sequence_length: int = field(
        default=0,
        metadata=about(
            "Longer sequences keep their first values (a tokenized text its first tokens, the "
            "tokenizer's special tokens kept); 0 = no cap.",
            bound=">= 0",
        ),
    )
    pad_to_max_length: bool = field(
        default=False,
        metadata=about(
            "Pad every batch's sequences to max_sequence_length, not to the batch's longest row: "
            "one shape for every batch (what compile wants), more padding."
        ),
    )
    tokenizer: str = field(
        default="",
        metadata=about(
            "A tokenizer.json (the Hugging Face tokenizers library's file) that tokenizes, on the "
            "executors, every input fed by one string column: token ids padded per batch, with a "
            "mask named by mask_input. Read on the driver and shipped with the tasks (at most "
            '64 MiB). "" = none.',
            valid='a path the driver reads (local, or any Hadoop-supported URL), or ""',
        ),
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
    perplexity_col: str = field(
        default="perplexity",
        metadata=about(
            "Double column of a language model's per-row perplexity that transform adds with "
            "loss_fn = causal_lm: exp of the mean next-token loss over the row's positions that have "
            "a next token (padding left out; NaN for a row of one token).",
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
        mask = self.mask_input.replace("{name}", "input")
        if not mask.isidentifier():
            raise ConfigError(
                f"data.mask_input = {self.mask_input!r} is not a keyword argument name once {{name}} is "
                'replaced; use e.g. "{name}_mask" or "attention_mask"'
            )
        if self.pad_to_max_length and self.max_sequence_length <= 0:
            raise ConfigError(
                "data.pad_to_max_length = true pads every sequence to max_sequence_length, which is 0 "
                "(no cap); set data.max_sequence_length (e.g. 128), or unset pad_to_max_length"
            )
        check_bounds(self, "data")
        check_local_directory(self.cache_dir, "data.cache_dir")
