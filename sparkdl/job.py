"""The main training job: bundled data set -> fit -> held-out evaluation -> files.

``jobs/train.py`` only parses arguments and calls :func:`run_train_job`; everything
the job does is here, so notebooks and tests can call it the same way.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkdl.config import SparkDLConfig, config_from_tables, load_toml
from sparkdl.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobSection:
    """``[job]``: the data set and the model of the main job."""

    dataset: str = "digits"
    test_fraction: float = 0.2
    hidden: tuple[int, ...] = (128,)
    dropout: float = 0.0
    input_partitions: int = 4

    def __post_init__(self) -> None:
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(f"job.test_fraction = {self.test_fraction} must be between 0 and 1")


@dataclass(frozen=True)
class SparkSection:
    """``[spark]``: the session. ``master = ""`` keeps what spark-submit set."""

    master: str = "local[2]"
    app_name: str = "sparkdl-train"
    conf: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class JobConfig:
    job: JobSection
    spark: SparkSection
    sparkdl: SparkDLConfig


def load_job_config(path: str | Path, overrides: Iterable[str] = ()) -> JobConfig:
    """Load a job TOML: ``[job]``, ``[spark]`` and the sparkdl sections."""
    raw = load_toml(path, overrides)
    library = typing.get_type_hints(SparkDLConfig)
    sections = {"job": JobSection, "spark": SparkSection, **library}
    built = config_from_tables(raw, str(path), sections)
    sparkdl = SparkDLConfig(**{name: built[name] for name in library})
    return JobConfig(job=built["job"], spark=built["spark"], sparkdl=sparkdl)


def run_train_job(config: JobConfig, output_dir: str | Path, spark: Any | None = None) -> dict[str, Any]:
    """Train on the bundled data set, evaluate on the held-out split, write the results.

    Writes ``metrics.json``, ``history.png`` (loss and samples/s per epoch) and the
    saved model (``model/``) under ``output_dir``.
    Returns the metrics.
    """
    from sparkdl.datasets import load_arrays, to_dataframe, train_test_split
    from sparkdl.estimator import TorchEstimator
    from sparkdl.models import MLPFactory
    from sparkdl.runtime.session import build_session

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if spark is None:
        spark = build_session(
            config.spark.master or None, config.spark.app_name, config.sparkdl, config.spark.conf
        )
    data = load_arrays(config.job.dataset)
    train, test = train_test_split(data, config.job.test_fraction, config.sparkdl.training.seed)
    train_df = to_dataframe(spark, train, config.job.input_partitions)
    test_df = to_dataframe(spark, test, config.job.input_partitions)
    model_fn = MLPFactory(train.features.shape[1], config.job.hidden, data.num_classes, config.job.dropout)
    estimator = TorchEstimator(model_fn=model_fn, config=config.sparkdl)
    started = time.perf_counter()
    model = estimator.fit(train_df)
    fit_seconds = time.perf_counter() - started
    for record in model.history:
        log.info(
            "epoch %d: loss %.4f, %d samples, %.0f samples/s (%s)",
            record["epoch"],
            record["loss"],
            record["samples"],
            record["samples_per_s"],
            record["source"],
        )
    predictions = model.transform(test_df).select("label", config.sparkdl.data.prediction_col).collect()
    correct = sum(int(row[0] == row[1]) for row in predictions)
    metrics = {
        "dataset": config.job.dataset,
        "train_rows": len(train.labels),
        "test_rows": len(predictions),
        "test_accuracy": correct / max(len(predictions), 1),
        "final_loss": model.history[-1]["loss"],
        "fit_seconds": fit_seconds,
        "history": model.history,
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.sparkdl.flat().items()},
        "job": dataclasses.asdict(config.job),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    model.plot_history(out / "history.png")
    model.write().overwrite().save(str((out / "model").resolve()))
    log.info(
        "held-out accuracy %.4f; wrote %s and %s",
        metrics["test_accuracy"],
        out / "metrics.json",
        out / "model",
    )
    return metrics
