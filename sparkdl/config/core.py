"""Typed settings: frozen dataclasses and enums, loaded from ``conf/*.toml``.

One source of truth for every setting. The same field names are accepted as
keyword arguments by :class:`sparkdl.TorchEstimator`, as ``[section]`` keys in a
TOML file, and as ``--set section.key=value`` overrides on the command line.
Precedence: defaults < file < ``--set`` overrides < keyword arguments.

Each field carries its meaning and valid values (``metadata=about(...)``), from which
:mod:`sparkdl.config.table` builds the table shown by ``python -m sparkdl settings``,
``TorchEstimator.explainParams()`` and docs/settings.md. A setting name belongs to exactly
one section (checked when this module is imported), so keyword arguments need no section.

A section checks its own values; a rule that involves one strategy (what weight averaging,
the parameter server or fsdp cannot combine with) lives in that strategy's class, above this
layer, and :func:`sparkdl.training.strategy.check_settings` applies it (TorchEstimator, the
jobs' loaders, fit and the advisor call it before any worker starts).

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
    LbfgsObjective,
    LrSchedule,
    OnError,
    OptimizerName,
    OuterOptimizer,
    PipelineBalance,
    PipelineSchedule,
    Precision,
    PsMode,
    Strategy,
    SufficientFactors,
    UseGpu,
)
from sparkdl.config.loading import (
    build_section,
    config_from_tables,
    load_toml,
    override_origins,
    parse_override,
    section_owners,
    unknown_names,
)
from sparkdl.config.runtime_sections import ReliabilityConfig, RuntimeConfig, TrackingConfig
from sparkdl.config.strategy_sections import (
    ParameterServerConfig,
    PipelineConfig,
    TensorConfig,
    WeightAveragingConfig,
)
from sparkdl.config.training_sections import DataConfig, LbfgsConfig, OptimizerConfig, TrainingConfig
from sparkdl.errors import ConfigError

__all__ = [
    "DEFAULT_LOSS",
    "LOSS_NAMES",
    "SECRET_SETTINGS",
    "SECTIONS",
    "Backend",
    "Compression",
    "DataConfig",
    "DrillKind",
    "FaultDrillSpec",
    "Hierarchy",
    "LbfgsConfig",
    "LbfgsObjective",
    "LrSchedule",
    "OnError",
    "OptimizerConfig",
    "OptimizerName",
    "OuterOptimizer",
    "ParameterServerConfig",
    "PipelineBalance",
    "PipelineConfig",
    "PipelineSchedule",
    "Precision",
    "PsMode",
    "ReliabilityConfig",
    "RuntimeConfig",
    "SparkDLConfig",
    "Strategy",
    "SufficientFactors",
    "TensorConfig",
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
    lbfgs: LbfgsConfig = field(default_factory=LbfgsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    weight_averaging: WeightAveragingConfig = field(default_factory=WeightAveragingConfig)
    parameter_server: ParameterServerConfig = field(default_factory=ParameterServerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    tensor: TensorConfig = field(default_factory=TensorConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

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

    def flat_shown(self) -> dict[str, Any]:
        """:meth:`flat` for logs, MLflow and reports: a setting of :data:`SECRET_SETTINGS`
        shows only its keys (credentials never leave the settings)."""
        return {
            name: sorted(value) if name in SECRET_SETTINGS else value for name, value in self.flat().items()
        }


#: Settings holding credentials: never logged, tracked, reported, nor saved with a model.
SECRET_SETTINGS: tuple[str, ...] = ("storage_options",)


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
    overrides = list(overrides)
    raw = load_toml(path, overrides)
    jobs_own = sorted(set(raw) & {"job", "etl", "spark"})
    if jobs_own:
        raise ConfigError(
            f"{path}: [{'], ['.join(jobs_own)}] belong to a job's config file, which "
            "sparkdl.apps.train_job.load_job_config (or sparkdl.apps.etl_job.load_etl_config) reads; "
            "this loader takes "
            "the library's sections only: use load_job_config(path).sparkdl"
        )
    return SparkDLConfig(**config_from_tables(raw, str(path), SECTIONS, override_origins(overrides)))
