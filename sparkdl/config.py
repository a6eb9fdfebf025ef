"""Typed settings: frozen dataclasses and enums, loaded from ``conf/*.toml``.

One source of truth for every setting. The same field names are accepted as
keyword arguments by :class:`sparkdl.TorchEstimator`, as ``[section]`` keys in a
TOML file, and as ``--set section.key=value`` overrides on the command line.
Precedence: defaults < file < ``--set`` overrides < keyword arguments.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import tomllib

from sparkdl.errors import ConfigError

T = TypeVar("T")


class Strategy(str, enum.Enum):
    """How workers keep their models in sync."""

    ALLREDUCE = "allreduce"
    WEIGHT_AVERAGING = "weight_averaging"
    PARAMETER_SERVER = "parameter_server"


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
    """Gradient compression applied by the all-reduce communication hook."""

    NONE = "none"
    FP16 = "fp16"


class OptimizerName(str, enum.Enum):
    """Optimizers that can be named in a config file (``optimizer_fn`` takes any)."""

    SGD = "sgd"
    ADAM = "adam"
    ADAMW = "adamw"
    ADAGRAD = "adagrad"


LOSS_NAMES = ("cross_entropy", "mse", "bce_with_logits")


@dataclass(frozen=True)
class TrainingConfig:
    """``[training]``: what to train and for how long."""

    num_workers: int = 2
    batch_size: int = 64
    epochs: int = 5
    seed: int = 0
    strategy: Strategy = Strategy.ALLREDUCE
    shuffle: bool = True
    loss: str = "cross_entropy"
    sync_every: int = 8
    average_optimizer_state: bool = True
    ps_mode: PsMode = PsMode.SYNC
    staleness: int = 2
    push_every: int = 1
    pull_every: int = 1

    def __post_init__(self) -> None:
        _require_positive(
            self, "num_workers", "batch_size", "epochs", "sync_every", "push_every", "pull_every"
        )
        if self.staleness < 0:
            raise ConfigError(f"training.staleness = {self.staleness} must be >= 0 (0 behaves as sync)")
        if self.loss not in LOSS_NAMES:
            raise ConfigError(
                f"training.loss = {self.loss!r} is not a known loss; choose one of "
                f"{', '.join(LOSS_NAMES)}, or pass a callable loss_fn to TorchEstimator"
            )


@dataclass(frozen=True)
class OptimizerConfig:
    """``[optimizer]``: used when no ``optimizer_fn`` is given."""

    optimizer: OptimizerName = OptimizerName.SGD
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optimizer.lr = {self.lr} must be > 0")
        if self.momentum < 0 or self.weight_decay < 0:
            raise ConfigError("optimizer.momentum and optimizer.weight_decay must be >= 0")


@dataclass(frozen=True)
class DataConfig:
    """``[data]``: which columns feed the model and how batches are fed."""

    feature_cols: tuple[str, ...] = ("features",)
    label_col: str = "label"
    prediction_col: str = "prediction"
    cache_dir: str = ""
    prefetch_batches: int = 4
    inference_batch_size: int = 1024

    def __post_init__(self) -> None:
        if not self.feature_cols:
            raise ConfigError("data.feature_cols is empty; name at least one feature column")
        if self.label_col in self.feature_cols:
            raise ConfigError(
                f"data.label_col = {self.label_col!r} is also a feature column; "
                "a model must not see its own label"
            )
        if self.prefetch_batches < 0:
            raise ConfigError(f"data.prefetch_batches = {self.prefetch_batches} must be >= 0 (0 disables)")
        _require_positive(self, "inference_batch_size")


@dataclass(frozen=True)
class RuntimeConfig:
    """``[runtime]``: devices, process group and the timeouts of every wait."""

    backend: Backend = Backend.AUTO
    use_gpu: UseGpu = UseGpu.AUTO
    collective_timeout_s: float = 300.0
    executor_wait_timeout_s: float = 30.0
    torch_threads: int = 0
    network_interface: str = ""
    compression: Compression = Compression.NONE
    bucket_cap_mb: float = 25.0
    ps_timeout_s: float = 120.0
    ps_shards: int = 4
    ps_max_frame_mb: float = 1024.0
    progress: bool = True  # live progress bars and worker warnings on the driver
    progress_interval_s: float = 0.5  # how often a worker reports, at most

    def __post_init__(self) -> None:
        _require_positive(
            self,
            "collective_timeout_s",
            "bucket_cap_mb",
            "ps_timeout_s",
            "ps_shards",
            "ps_max_frame_mb",
            "progress_interval_s",
        )
        if self.executor_wait_timeout_s < 0 or self.torch_threads < 0:
            raise ConfigError("runtime.executor_wait_timeout_s and runtime.torch_threads must be >= 0")
        if self.backend is Backend.NCCL and self.use_gpu is UseGpu.NO:
            raise ConfigError(
                "runtime.backend = 'nccl' needs GPUs but runtime.use_gpu = false; "
                "set backend = 'gloo' or 'auto', or use_gpu = 'auto'"
            )


@dataclass(frozen=True)
class ReliabilityConfig:
    """``[reliability]``: checkpoints, resume, and what to do about bad input."""

    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    on_bad_rows: OnError = OnError.ERROR
    on_nan_loss: OnError = OnError.ERROR
    max_nan_skips: int = 10
    fault_injection: str = ""

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0 or self.max_nan_skips < 0:
            raise ConfigError("reliability.checkpoint_every and reliability.max_nan_skips must be >= 0")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError(
                f"reliability.checkpoint_every = {self.checkpoint_every} but no checkpoint_dir is set; "
                "set checkpoint_dir to a directory every executor and the driver can reach"
            )
        if self.fault_injection and len(self.fault_injection.split(":", 3)) != 4:
            raise ConfigError(
                f"reliability.fault_injection = {self.fault_injection!r}; the form is "
                "'raise|exit|hang|killjvm:RANK:STEP:MARKER_FILE' "
                "(a drill: fires once, when MARKER_FILE is absent)"
            )


@dataclass(frozen=True)
class TrackingConfig:
    """``[tracking]``: MLflow logging (needs the ``mlflow`` extra and a tracking URI)."""

    mlflow: bool = True  # log when MLflow is installed and a tracking URI is set
    mlflow_experiment: str = ""  # experiment name; "" = MLflow's active/default one
    mlflow_run_name: str = ""
    mlflow_log_model: bool = True


@dataclass(frozen=True)
class SparkDLConfig:
    """Every setting of a training run, grouped as in the TOML file."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        every, tau = self.reliability.checkpoint_every, self.training.sync_every
        if self.training.strategy is Strategy.WEIGHT_AVERAGING and every and every % tau:
            raise ConfigError(
                f"checkpoint_every = {every} is not a multiple of sync_every = {tau}; weight averaging "
                "checkpoints right after an average, when every worker holds the same weights"
            )

    def replace(self, **flat: Any) -> SparkDLConfig:
        """Return a copy with settings given by their field name (``batch_size=32``).

        Raises:
            ConfigError: a name is not a setting, or a value has the wrong type.
        """
        by_section: dict[str, dict[str, Any]] = {}
        owners = flat_field_owners()
        for name, value in flat.items():
            if name not in owners:
                raise ConfigError(
                    f"{name!r} is not a sparkdl setting; valid names: {', '.join(sorted(owners))}"
                )
            by_section.setdefault(owners[name], {})[name] = value
        changes = {}
        for section, values in by_section.items():
            current = getattr(self, section)
            merged = {**dataclasses.asdict(current), **values}
            changes[section] = _build(type(current), merged, f"[{section}]")
        return dataclasses.replace(self, **changes)

    def flat(self) -> dict[str, Any]:
        """Every setting by field name, with enums as their string values."""
        out: dict[str, Any] = {}
        for section in dataclasses.fields(self):
            for name, value in dataclasses.asdict(getattr(self, section.name)).items():
                out[name] = value.value if isinstance(value, enum.Enum) else value
        return out


def flat_field_owners() -> dict[str, str]:
    """Map each setting's field name to the section that holds it."""
    owners: dict[str, str] = {}
    for section in dataclasses.fields(SparkDLConfig):
        section_type = typing.get_type_hints(SparkDLConfig)[section.name]
        for f in dataclasses.fields(section_type):
            owners[f.name] = section.name
    return owners


def load_toml(path: str | Path, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """Read a TOML file and apply ``section.key=value`` overrides to the raw tables."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    for item in overrides:
        section, key, value = parse_override(item)
        raw.setdefault(section, {})[key] = value
    return raw


def parse_override(item: str) -> tuple[str, str, Any]:
    """Parse ``section.key=value``; the value is read as TOML, else taken as a string."""
    name, sep, text = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"override {item!r} is not of the form section.key=value (e.g. training.epochs=3)")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return section, key.strip(), value


def config_from_tables(
    raw: Mapping[str, Any], source: str, sections: Mapping[str, type[Any]]
) -> dict[str, Any]:
    """Build one dataclass per expected section; unknown sections or keys are errors."""
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise ConfigError(
            f"{source}: unknown section(s) {', '.join(unknown)}; valid sections: {', '.join(sections)}"
        )
    out = {}
    for name, cls in sections.items():
        table = raw.get(name, {})
        if not isinstance(table, Mapping):
            raise ConfigError(f"{source}: [{name}] must be a table, got {table!r}")
        out[name] = _build(cls, table, f"{source} [{name}]")
    return out


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> SparkDLConfig:
    """Load a :class:`SparkDLConfig` from a TOML file holding only sparkdl sections."""
    raw = load_toml(path, overrides)
    sections = typing.get_type_hints(SparkDLConfig)
    return SparkDLConfig(**config_from_tables(raw, str(path), sections))


def _build(cls: type[T], table: Mapping[str, Any], where: str) -> T:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(table) - names)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(names))}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{where} {k}") for k, v in table.items()}
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        text = str(value).lower() if isinstance(value, bool | str) else value
        if isinstance(value, hint):
            return value
        try:
            return hint(text)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in hint)
            raise ConfigError(f"{where} = {value!r} is not valid; choose one of {choices}") from None
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} = {value!r} must be a list")
        (item_type, _) = typing.get_args(hint)
        return tuple(_coerce(v, item_type, where) for v in value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} = {value!r} must be a table")
        return {str(k): str(v) for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not _is_exact(value, hint):
        raise ConfigError(f"{where} = {value!r} must be of type {hint.__name__}")
    return value


def _is_exact(value: Any, hint: type) -> bool:
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _require_positive(obj: Any, *names: str) -> None:
    section = type(obj).__name__.replace("Config", "").lower()
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ConfigError(f"{section}.{name} = {value} must be > 0")
