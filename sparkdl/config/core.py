"""Typed settings: frozen dataclasses and enums, loaded from ``conf/*.toml``.

One source of truth for every setting. The same field names are accepted as
keyword arguments by :class:`sparkdl.TorchEstimator`, as ``[section]`` keys in a
TOML file, and as ``--set section.key=value`` overrides on the command line.
Precedence: defaults < file < ``--set`` overrides < keyword arguments.

Each field carries its meaning and valid values (``metadata=about(...)``), from which
:mod:`sparkdl.config.table` builds the table shown by ``python -m sparkdl settings``,
``TorchEstimator.explainParams()`` and docs/settings.md. A setting name belongs to exactly
one section (checked when this module is imported), so keyword arguments need no section.

The sections live in :mod:`sparkdl.config.training_sections` (training, optimizer, data),
:mod:`sparkdl.config.runtime_sections` (runtime, reliability, tracking) and
:mod:`sparkdl.config.strategy_sections` (weight averaging, parameter server), their choices
(enums, the fault-drill form) in :mod:`sparkdl.config.choices`, TOML reading in
:mod:`sparkdl.config.loading`; this module puts them together and re-exports them.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkdl.config.choices import (
    DEFAULT_LOSS,
    LOSS_NAMES,
    Backend,
    Compression,
    DrillKind,
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
from sparkdl.config.loading import (
    build_section,
    config_from_tables,
    load_toml,
    parse_override,
    section_owners,
    unknown_names,
)
from sparkdl.config.runtime_sections import ReliabilityConfig, RuntimeConfig, TrackingConfig
from sparkdl.config.strategy_sections import ParameterServerConfig, WeightAveragingConfig
from sparkdl.config.training_sections import DataConfig, OptimizerConfig, TrainingConfig
from sparkdl.errors import ConfigError

__all__ = [
    "DEFAULT_LOSS",
    "LOSS_NAMES",
    "SECTIONS",
    "Backend",
    "Compression",
    "DataConfig",
    "DrillKind",
    "FaultDrillSpec",
    "Hierarchy",
    "LrSchedule",
    "OnError",
    "OptimizerConfig",
    "OptimizerName",
    "ParameterServerConfig",
    "Precision",
    "PsMode",
    "ReliabilityConfig",
    "RuntimeConfig",
    "SparkDLConfig",
    "Strategy",
    "TrackingConfig",
    "TrainingConfig",
    "UseGpu",
    "WeightAveragingConfig",
    "check_setting_names",
    "config_from_tables",
    "flat_field_owners",
    "load_config",
    "load_toml",
    "parse_override",
]


@dataclass(frozen=True)
class SparkDLConfig:
    """Every setting of a training run, grouped as in the TOML file."""

    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    weight_averaging: WeightAveragingConfig = field(default_factory=WeightAveragingConfig)
    parameter_server: ParameterServerConfig = field(default_factory=ParameterServerConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        every, tau = self.reliability.checkpoint_every, self.weight_averaging.sync_every
        if self.training.strategy is Strategy.WEIGHT_AVERAGING and every and every % tau:
            raise ConfigError(
                f"checkpoint_every = {every} is not a multiple of sync_every = {tau}; weight averaging "
                "checkpoints right after an average, when every worker holds the same weights"
            )
        if self.training.strategy is Strategy.WEIGHT_AVERAGING:
            _check_weight_averaging(self)
        if self.training.strategy is Strategy.FSDP:
            _check_fsdp(self)
        backups, workers = self.parameter_server.backup_workers, self.training.num_workers
        if self.training.strategy is Strategy.PARAMETER_SERVER and backups >= workers:
            raise ConfigError(
                f"backup_workers = {backups} must be < num_workers = {workers}: each step is made by "
                f"the first num_workers - backup_workers pushes, so at least one; set backup_workers to "
                f"at most {workers - 1} (0 waits for every worker), or raise num_workers"
            )
        if self.training.strategy is Strategy.PARAMETER_SERVER and self.training.precision is Precision.FP16:
            raise ConfigError(
                "precision = 'fp16' needs a gradient scaler next to the optimizer, and the parameter "
                "server's optimizer runs on the driver; use precision = 'bf16' with the parameter server"
            )
        if (
            self.runtime.compression is Compression.POWERSGD
            and self.training.strategy is not Strategy.ALLREDUCE
        ):
            raise ConfigError(
                f"compression = 'powersgd' is PyTorch's DDP hook of strategy 'allreduce'; with strategy = "
                f"{self.training.strategy.value!r} use '1bit', 'topk', 'fp16' or 'bf16'"
            )

        if self.runtime.hierarchy is not Hierarchy.NONE:
            _check_hierarchy(self)

    def replace(self, **flat: Any) -> SparkDLConfig:
        """Return a copy with settings given by their field name (``batch_size=32``).

        Raises:
            ConfigError: a name is not a setting, or a value has the wrong type.
        """
        check_setting_names(flat)
        by_section: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            by_section.setdefault(_OWNERS[name], {})[name] = value
        changes = {}
        for section, values in by_section.items():
            current = getattr(self, section)
            merged = {**{f.name: getattr(current, f.name) for f in dataclasses.fields(current)}, **values}
            changes[section] = build_section(type(current), merged, "", section, {})
        return dataclasses.replace(self, **changes)

    def flat(self) -> dict[str, Any]:
        """Every setting by field name, with enums as their string values."""
        out: dict[str, Any] = {}
        for section in dataclasses.fields(self):
            for name, value in dataclasses.asdict(getattr(self, section.name)).items():
                out[name] = value.value if isinstance(value, enum.Enum) else value
        return out


SECTIONS: dict[str, type[Any]] = typing.get_type_hints(SparkDLConfig)  # the library's, in file order
_OWNERS = section_owners(SECTIONS)  # a name declared by two sections fails here, at import


def flat_field_owners() -> dict[str, str]:
    """Map each setting's field name to the section that holds it."""
    return dict(_OWNERS)


def check_setting_names(names: Iterable[str]) -> None:
    """Raise ConfigError for names that are not settings, suggesting the closest one.

    Raises:
        ConfigError: e.g. ``unknown setting 'batch_sise'; did you mean 'batch_size'?``
    """
    unknown = [name for name in names if name not in _OWNERS]
    if unknown:
        raise ConfigError(unknown_names("setting", unknown, _OWNERS))


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> SparkDLConfig:
    """Load a :class:`SparkDLConfig` from a TOML file holding only sparkdl sections."""
    raw = load_toml(path, overrides)
    jobs_own = sorted(set(raw) & {"job", "etl", "spark"})
    if jobs_own:
        raise ConfigError(
            f"{path}: [{'], ['.join(jobs_own)}] belong to a job's config file, which "
            "sparkdl.apps.train_job.load_job_config (or sparkdl.apps.etl_job.load_etl_config) reads; "
            "this loader takes "
            "the library's sections only: use load_job_config(path).sparkdl"
        )
    return SparkDLConfig(**config_from_tables(raw, str(path), SECTIONS))


def _check_hierarchy(config: SparkDLConfig) -> None:
    """What hierarchical aggregation cannot be combined with, refused with the fix."""
    strategy, compression = config.training.strategy, config.runtime.compression
    level = config.runtime.hierarchy.value
    if strategy is Strategy.FSDP:
        raise ConfigError(
            f"hierarchy = {level!r} is not available with strategy = 'fsdp' (its collectives are FSDP's "
            "own); set hierarchy = 'none'"
        )
    if strategy is not Strategy.PARAMETER_SERVER and compression is not Compression.NONE:
        raise ConfigError(
            f"hierarchy = {level!r} and compression = {compression.value!r} do not combine with strategy "
            f"{strategy.value!r} (the leaders exchange float32); choose one of them"
        )
    if strategy is Strategy.WEIGHT_AVERAGING and config.weight_averaging.wa_backup_workers:
        raise ConfigError(
            f"hierarchy = {level!r} with wa_backup_workers = {config.weight_averaging.wa_backup_workers}: "
            "backup workers are not available with two-level averaging yet; set wa_backup_workers = 0 "
            "or hierarchy = 'none'"
        )
    if strategy is Strategy.PARAMETER_SERVER and config.parameter_server.backup_workers:
        raise ConfigError(
            f"hierarchy = {level!r} with backup_workers = {config.parameter_server.backup_workers}: with "
            "a hierarchy the hosts' leaders push, not the workers; set backup_workers = 0"
        )


def _check_weight_averaging(config: SparkDLConfig) -> None:
    """What weight averaging's settings must agree with, refused with the fix."""
    backups, workers = config.weight_averaging.wa_backup_workers, config.training.num_workers
    if backups >= workers:
        raise ConfigError(
            f"wa_backup_workers = {backups} must be < num_workers = {workers}: each period ends once "
            f"num_workers - wa_backup_workers workers finished it, so at least one must; set "
            f"wa_backup_workers to at most {workers - 1} (0 waits for every worker), or raise num_workers"
        )


def _check_fsdp(config: SparkDLConfig) -> None:
    """What strategy "fsdp" cannot do yet, refused with the fix."""
    if config.training.precision is Precision.FP16:
        raise ConfigError(
            "precision = 'fp16' is not available with strategy = 'fsdp' (its gradient scaler would "
            "have to agree on overflows across the gradient shards); use precision = 'bf16', or "
            "strategy = 'allreduce'"
        )
    if config.runtime.compression is not Compression.NONE:
        raise ConfigError(
            f"compression = {config.runtime.compression.value!r} is not available with strategy = 'fsdp' "
            "(its gathers and reduce-scatters have no compression hook); set compression = 'none'"
        )
