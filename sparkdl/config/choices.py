"""The choices a setting can name: enums, loss names, and the fault-drill form.

Kept apart from the sections (:mod:`sparkdl.config`, which re-exports all of them) so
that both stay small; everything here is validated when a config is built.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sparkdl.errors import ConfigError


class Strategy(str, enum.Enum):
    """How workers keep their models in sync."""

    ALLREDUCE = "allreduce"
    WEIGHT_AVERAGING = "weight_averaging"
    PARAMETER_SERVER = "parameter_server"
    FSDP = "fsdp"
    PIPELINE = "pipeline"
    TENSOR = "tensor"


class PsMode(str, enum.Enum):
    """Parameter-server consistency: synchronous, asynchronous (Downpour), stale-synchronous."""

    SYNC = "sync"
    ASYNC = "async"
    SSP = "ssp"


class Backend(str, enum.Enum):
    """torch.distributed backend; ``auto`` is NCCL on GPU, gloo on CPU."""

    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


class UseGpu(str, enum.Enum):
    """Whether to train on GPU; ``auto`` uses one when the task was given one."""

    AUTO = "auto"
    YES = "true"
    NO = "false"


class OnError(str, enum.Enum):
    """What to do with bad input rows or a non-finite loss."""

    ERROR = "error"
    SKIP = "skip"


class Compression(str, enum.Enum):
    """What the strategies compress before it travels (see sparkdl.comm.compression)."""

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    ONEBIT = "1bit"
    TOPK = "topk"
    POWERSGD = "powersgd"  # PyTorch's own low-rank DDP hook: all-reduce only


class SufficientFactors(str, enum.Enum):
    """Whether fully connected layers' gradients travel as factors (see sparkdl.comm.factors)."""

    OFF = "off"
    ON = "on"  # every nn.Linear, every step
    AUTO = "auto"  # per layer and step, whichever of factors and matrix sends fewer bytes


class Hierarchy(str, enum.Enum):
    """What counts as one host for hierarchical aggregation (see sparkdl.comm.hierarchy)."""

    NONE = "none"
    HOST = "host"  # tasks with the same address
    EXECUTOR = "executor"  # tasks of the same executor (several executors may share a host)


class LbfgsObjective(str, enum.Enum):
    """What ``optimizer = "lbfgs"`` minimizes."""

    MEAN = "mean"  # mean loss over every row (weighted rows over the row count), L2 on every weight
    SPARK = "spark"  # Spark ML's LogisticRegression's: weighted rows over the weights' sum, no L2 on biases


class LrSchedule(str, enum.Enum):
    """How the learning rate changes over the run."""

    CONSTANT = "constant"
    WARMUP_COSINE = "warmup_cosine"
    WARMUP_LINEAR = "warmup_linear"
    STEP = "step"


class Precision(str, enum.Enum):
    """The dtype of the forward pass (autocast); weights and optimizer stay float32."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class OuterOptimizer(str, enum.Enum):
    """What weight averaging does with a round's average (DiLoCo's outer optimizer)."""

    NONE = "none"  # the average is the new model (SparkNet, local SGD)
    NESTEROV = "nesterov"  # the average change is a pseudo-gradient for Nesterov momentum SGD


class PipelineSchedule(str, enum.Enum):
    """The order a pipeline's stages run their micro-batches' forwards and backwards in."""

    GPIPE = "gpipe"  # every forward, then every backward: activations of all micro-batches held
    ONE_F_ONE_B = "1f1b"  # one forward, one backward in the steady state: at most `stages` held


class PipelineBalance(str, enum.Enum):
    """What a pipeline's automatic cut evens out between its stages."""

    PARAMETERS = "parameters"  # the same number of parameters (memory) in every stage
    TIME = "time"  # the same forward + backward time, measured on the driver before training


class OptimizerName(str, enum.Enum):
    """Optimizers that can be named in a config file (``optimizer_fn`` takes any)."""

    SGD = "sgd"
    ADAM = "adam"
    ADAMW = "adamw"
    ADAGRAD = "adagrad"
    LBFGS = "lbfgs"  # full-batch: every iteration a pass over all rows ([lbfgs])


class DrillKind(str, enum.Enum):
    """What a fault drill does: raise before the step, exit mid-backward, hang, kill the
    executor JVM, or (slow) take three times as long over every step from STEP on."""

    RAISE = "raise"
    EXIT = "exit"
    HANG = "hang"
    KILLJVM = "killjvm"
    SLOW = "slow"


LOSS_NAMES = ("cross_entropy", "mse", "bce_with_logits", "causal_lm")
DEFAULT_LOSS = "cross_entropy"
DRILL_FORM = "KIND:RANK:STEP:MARKER_FILE with KIND one of " + ", ".join(k.value for k in DrillKind)


@dataclass(frozen=True)
class FaultDrillSpec:
    """A fault injected on purpose (``reliability.fault_injection``), parsed and validated.

    Fires once, on ``rank`` at global step ``step``, unless ``marker`` exists (the drill
    creates it when it fires; an empty marker fires on every attempt).
    """

    kind: DrillKind
    rank: int
    step: int
    marker: str

    @classmethod
    def parse(cls, text: str) -> FaultDrillSpec:
        """Parse ``kind:rank:step:marker`` (the marker may itself contain ``:``).

        Raises:
            ConfigError: naming the value, the valid form and the valid kinds.
        """
        where = f"reliability.fault_injection = {text!r}"
        parts = text.split(":", 3)
        if len(parts) != 4:
            raise ConfigError(
                f"{where}; the form is {DRILL_FORM} (a drill fires once, when MARKER_FILE is absent)"
            )
        kind, rank, step, marker = parts
        try:
            drill_kind = DrillKind(kind.strip().lower())
        except ValueError:
            raise ConfigError(f"{where}: {kind!r} is not a drill kind; the form is {DRILL_FORM}") from None
        return cls(drill_kind, _index(where, "RANK", rank), _index(where, "STEP", step), marker)


def _index(where: str, label: str, text: str) -> int:
    if not text.strip().isdigit():
        raise ConfigError(f"{where}: {label} = {text!r} must be an integer >= 0; the form is {DRILL_FORM}")
    return int(text)
