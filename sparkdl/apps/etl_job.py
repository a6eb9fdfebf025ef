"""ETL to training: raw files -> Spark SQL feature steps -> fit -> predictions as Parquet.

The whole thing is one ``pyspark.ml`` Pipeline whose last stage is the
:class:`~sparkdl.TorchEstimator`, so the feature steps fitted on the training rows
are replayed, unchanged, on the held-out rows and on any later data
(``PipelineModel.load(out/pipeline).transform(new_raw_rows)`` inside
``sparkdl.loading(model_fn=MLPFactory(features, hidden, classes, dropout))``, so that
loading runs no code from the directory).

    SQLTransformer (clean / derive columns in SQL)
      -> StringIndexer (label text -> class index)
      -> VectorAssembler (numeric columns -> one vector)
      -> StandardScaler (fitted on the training rows)
      -> TorchEstimator
      -> IndexToString (class index -> label text), after the pipeline

``jobs/etl_to_train.py`` parses arguments and calls :func:`run_etl_job`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from sparkdl.apps.train_job import SparkSection, load_job_sections
from sparkdl.config import SparkDLConfig
from sparkdl.config.loading import about
from sparkdl.errors import ConfigError, SchemaError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EtlSection:
    """``[etl]``: where the raw rows are, how to turn them into features, where results go."""

    input_path: str = field(
        default="data/raw/digits.csv",
        metadata=about(
            "Raw rows: a file or directory, local or a URI every executor can read (hdfs://, s3a://, dbfs:/)."
        ),
    )
    input_format: str = field(
        default="csv",
        metadata=about("Format of the raw rows (csv with a header row).", valid="csv or parquet"),
    )
    write_sample: bool = field(
        default=True, metadata=about("When input_path is missing, write the bundled digits there first.")
    )
    label_column: str = field(
        default="digit", metadata=about("Raw label column (text labels are indexed alphabetically).")
    )
    feature_columns: tuple[str, ...] = field(
        default=(),
        metadata=about("Raw numeric columns to assemble; [] = every numeric column but the label."),
    )
    feature_sql: str = field(
        default="SELECT * FROM __THIS__",
        metadata=about(
            "A Spark SQL step over the raw rows (drop rows, derive columns).", valid="reads FROM __THIS__"
        ),
    )
    test_fraction: float = field(
        default=0.2,
        metadata=about("Held-out share of the rows for the accuracy figure.", valid="between 0 and 1"),
    )
    hidden: tuple[int, ...] = field(default=(128,), metadata=about("Hidden layer sizes of the MLP."))
    dropout: float = field(
        default=0.0, metadata=about("Dropout after each hidden layer.", valid="0 <= p < 1")
    )

    def __post_init__(self) -> None:
        if self.input_format not in ("csv", "parquet"):
            raise ConfigError(f"etl.input_format = {self.input_format!r}; use 'csv' or 'parquet'")
        if "__THIS__" not in self.feature_sql:
            raise ConfigError("etl.feature_sql must read FROM __THIS__ (the raw rows)")
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(f"etl.test_fraction = {self.test_fraction} must be between 0 and 1")


ETL_EPILOG = """\
data: your own rows, set in the config's [etl] section or with --set:
  --set etl.input_path=PATH       a file or directory, local or a URI every executor
                                  can read (hdfs://, s3a://, dbfs:/)
  --set etl.input_format=FORMAT   csv (with a header row) or parquet
  --set etl.label_column=COLUMN   the label (text labels are indexed alphabetically)
  --set etl.feature_columns='["a", "b"]'
                                  numeric columns to assemble ([] = every numeric one
                                  but the label)
  --set etl.feature_sql='SELECT * FROM __THIS__'
                                  a Spark SQL step over the raw rows first; conf/etl.toml's
                                  keeps the rows with a digit, so set your own
With no input at etl.input_path and etl.write_sample = true, the bundled digits are
written there first, so the job runs offline as is.

Every setting, with its default and meaning: .venv/bin/python -m sparkdl settings
(docs/settings.md)."""


@dataclass(frozen=True)
class EtlConfig:
    etl: EtlSection
    spark: SparkSection
    sparkdl: SparkDLConfig


def load_etl_config(path: str | Path, overrides: Iterable[str] = ()) -> EtlConfig:
    """Load an ETL job TOML: ``[etl]``, ``[spark]`` and the sparkdl sections."""
    sections, sparkdl = load_job_sections(path, overrides, {"etl": EtlSection})
    return EtlConfig(etl=sections["etl"], spark=sections["spark"], sparkdl=sparkdl)


def write_sample_input(path: str | Path, input_format: str) -> Path:
    """The bundled digits as raw rows: 64 integer pixel columns and the digit's name."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits

    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    bunch = load_digits()
    columns = {f"pixel_{i}": pa.array(bunch.data[:, i].astype(np.int32)) for i in range(bunch.data.shape[1])}
    columns["digit"] = pa.array([names[t] for t in bunch.target])
    table = pa.table(columns)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if input_format == "csv":
        pa_csv.write_csv(table, target)
    else:
        pq.write_table(table, target)
    return target


def build_pipeline(etl: EtlSection, sparkdl: SparkDLConfig, feature_columns: list[str], classes: int) -> Any:
    """The feature steps and the estimator, as one unfitted Pipeline."""
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import SQLTransformer, StandardScaler, StringIndexer, VectorAssembler

    from sparkdl.apps.models import MLPFactory
    from sparkdl.ml.estimator import TorchEstimator

    data = sparkdl.data
    model_fn = MLPFactory(len(feature_columns), etl.hidden, classes, etl.dropout)
    return Pipeline(
        stages=[
            SQLTransformer(statement=etl.feature_sql),
            StringIndexer(inputCol=etl.label_column, outputCol=data.label_col, stringOrderType="alphabetAsc"),
            VectorAssembler(inputCols=feature_columns, outputCol="raw_features", handleInvalid="keep"),
            StandardScaler(inputCol="raw_features", outputCol=data.feature_cols[0], withMean=True),
            TorchEstimator(model_fn=model_fn, config=sparkdl),
        ]
    )


def _read_raw(spark: Any, etl: EtlSection) -> Any:
    """The raw rows; a missing local input is first written from the bundled digits when
    ``etl.write_sample`` asks for it."""
    location = etl.input_path
    if len(urlparse(location).scheme) <= 1:  # a local path (the sample is only written to one)
        source = Path(location)
        if etl.write_sample and not source.exists():
            log.info("no raw input at %s: writing the bundled digits there", source)
            write_sample_input(source, etl.input_format)
        location = str(source.resolve())
    reader = spark.read.format(etl.input_format)
    if etl.input_format == "csv":
        reader = reader.option("header", True).option("inferSchema", True)
    return reader.load(location)


def run_etl_job(config: EtlConfig, output_dir: str | Path, spark: Any | None = None) -> dict[str, Any]:
    """Read raw rows, fit the pipeline on the training split, predict the held-out split.

    Writes under ``output_dir``: ``predictions/`` (Parquet: the raw label, the
    predicted label and the class index), ``pipeline/`` (the fitted PipelineModel),
    ``metrics.json`` and ``history.png``. Returns the metrics.
    """
    from pyspark.ml.feature import IndexToString

    from sparkdl.spark.session import build_session

    etl, sparkdl = config.etl, config.sparkdl
    if len(sparkdl.data.feature_cols) != 1:
        raise ConfigError("the ETL job assembles one feature vector: set data.feature_cols to one name")
    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if spark is None:
        spark = build_session(config.spark.master or None, config.spark.app_name, sparkdl, config.spark.conf)
    raw = _read_raw(spark, etl)
    features = list(etl.feature_columns) or _numeric_columns(raw, etl.label_column)
    classes = raw.select(etl.label_column).distinct().count()
    train, test = raw.randomSplit([1.0 - etl.test_fraction, etl.test_fraction], seed=sparkdl.training.seed)
    pipeline = build_pipeline(etl, sparkdl, features, classes)
    started = time.perf_counter()
    fitted = pipeline.fit(train)
    fit_seconds = time.perf_counter() - started
    indexer, torch_model = fitted.stages[1], fitted.stages[-1]
    to_text = IndexToString(
        inputCol=sparkdl.data.prediction_col, outputCol=f"predicted_{etl.label_column}", labels=indexer.labels
    )
    predictions = to_text.transform(fitted.transform(test)).select(
        etl.label_column, f"predicted_{etl.label_column}", sparkdl.data.label_col, sparkdl.data.prediction_col
    )
    predictions.write.mode("overwrite").parquet(str(out / "predictions"))
    written = spark.read.parquet(str(out / "predictions"))
    hits = f"int({etl.label_column} = predicted_{etl.label_column})"
    rows, correct = written.selectExpr("count(*)", f"coalesce(sum({hits}), 0)").first()
    fitted.write().overwrite().save(str(out / "pipeline"))
    torch_model.plot_history(out / "history.png")
    metrics = {
        "input": etl.input_path,
        "feature_columns": len(features),
        "classes": classes,
        "test_rows": rows,
        "test_accuracy": correct / max(rows, 1),
        "final_loss": torch_model.history[-1]["loss"],
        "fit_seconds": fit_seconds,
        "history": torch_model.history,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    log.info("held-out accuracy %.4f on %d rows; wrote %s", metrics["test_accuracy"], rows, out)
    return metrics


def _numeric_columns(df: Any, label: str) -> list[str]:
    from pyspark.sql.types import NumericType

    columns = [f.name for f in df.schema.fields if isinstance(f.dataType, NumericType) and f.name != label]
    if not columns:
        raise SchemaError(
            f"the raw rows have no numeric column besides {label!r}: {df.schema.simpleString()}"
        )
    return columns
