"""The streaming job: Parquet files landing in a directory -> a model trained per micro-batch.

Spark's file source reads ``stream.input_path`` with a schema, ``max_files_per_trigger``
files per micro-batch; each micro-batch is fitted from the version before it and published
as ``<model_dir>/batch-<id>/`` (:mod:`sparkdl.ml.streaming`). Killed and started again with
the same ``checkpoint_location``, the job goes on where it stopped: no file is trained
twice or lost. ``trigger = "available_now"`` trains the files there and stops (a job a
scheduler runs hourly); ``"processing_time"`` keeps watching for ``run_for_s``.

``jobs/stream_train.py`` parses arguments and calls :func:`run_stream_job`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from sparkdl.apps.train_job import SparkSection, load_job_sections
from sparkdl.config import SparkDLConfig
from sparkdl.config.loading import about, check_bounds
from sparkdl.errors import ConfigError, SparkDLError, WaitTimeout

log = logging.getLogger(__name__)

TRIGGERS = ("available_now", "processing_time")


@dataclass(frozen=True)
class StreamSection:
    """``[stream]``: the directory watched, the model, where versions and the checkpoint go."""

    input_path: str = field(
        default="data/stream/in",
        metadata=about(
            "Directory of Parquet files the stream reads as they arrive: local or a URI every "
            "executor can read (hdfs://, s3a://, dbfs:/)."
        ),
    )
    schema: str = field(
        default="",
        metadata=about(
            "The files' schema as Spark DDL, e.g. 'features array<float>, label long'; \"\" reads it "
            "from the files already there."
        ),
    )
    max_files_per_trigger: int = field(
        default=1, metadata=about("Files per micro-batch (Spark's maxFilesPerTrigger).", bound="> 0")
    )
    model_dir: str = field(
        default="",
        metadata=about(
            'Where a version per micro-batch is published (local or a URL); "" = models/ under the job\'s '
            "--output."
        ),
    )
    keep_versions: int = field(
        default=0,
        metadata=about(
            "How many of the newest model versions to keep under model_dir (older ones removed after "
            "each publish); 0 keeps them all.",
            bound=">= 0",
        ),
    )
    checkpoint_location: str = field(
        default="",
        metadata=about(
            "The query's checkpoint: restart with the same one to go on where it stopped; "
            '"" = checkpoint/ under the job\'s --output.'
        ),
    )
    trigger: str = field(
        default="available_now",
        metadata=about(
            "available_now: train the files there, then stop; processing_time: a micro-batch every "
            "trigger_interval_s for run_for_s.",
            valid="available_now or processing_time",
        ),
    )
    trigger_interval_s: float = field(
        default=10.0, metadata=about("Seconds between micro-batches (processing_time).", bound="> 0")
    )
    run_for_s: float = field(
        default=0.0,
        metadata=about(
            "processing_time: stop the query after this many seconds; 0 = until the job is stopped.",
            bound=">= 0",
        ),
    )
    timeout_s: float = field(
        default=3600.0,
        metadata=about(
            "available_now: the longest the job waits for the files there to be trained.", bound="> 0"
        ),
    )
    write_sample: bool = field(
        default=True,
        metadata=about(
            "When input_path has no file, write the bundled digits there first (sample_files files)."
        ),
    )
    sample_files: int = field(
        default=4, metadata=about("Files the bundled digits are split into (write_sample).", bound="> 0")
    )
    input_size: int = field(default=64, metadata=about("Features per row: the MLP's input.", bound="> 0"))
    classes: int = field(default=10, metadata=about("Classes: the MLP's outputs.", bound="> 0"))
    hidden: tuple[int, ...] = field(default=(64,), metadata=about("Hidden layer sizes of the MLP."))
    dropout: float = field(
        default=0.0, metadata=about("Dropout after each hidden layer.", valid="0 <= p < 1")
    )

    def __post_init__(self) -> None:
        if self.trigger not in TRIGGERS:
            raise ConfigError(f"stream.trigger = {self.trigger!r}; use one of {', '.join(TRIGGERS)}")
        check_bounds(self, "stream")


STREAM_EPILOG = """\
data: Parquet files landing in a directory, set in the config's [stream] section or with --set:
  --set stream.input_path=DIR      the directory watched, local or a URI every executor can
                                   read (hdfs://, s3a://, dbfs:/)
  --set stream.schema='features array<float>, label long'
                                   the files' schema ("" reads it from the files there)
  --set stream.trigger=available_now   train the files there, then stop (processing_time:
                                   keep watching for stream.run_for_s)
Versions go to stream.model_dir (<output>/models), one per micro-batch; restart with the
same stream.checkpoint_location (<output>/checkpoint) to go on where the job stopped.
With no file at stream.input_path and stream.write_sample = true, the bundled digits are
written there first, so the job runs offline as is.

Every setting, with its default and meaning: .venv/bin/python -m sparkdl settings
(docs/settings.md)."""


@dataclass(frozen=True)
class StreamConfig:
    stream: StreamSection
    spark: SparkSection
    sparkdl: SparkDLConfig


def load_stream_config(path: str | Path, overrides: Iterable[str] = ()) -> StreamConfig:
    """Load a streaming job TOML: ``[stream]``, ``[spark]`` and the sparkdl sections."""
    sections, sparkdl = load_job_sections(path, overrides, {"stream": StreamSection})
    return StreamConfig(stream=sections["stream"], spark=sections["spark"], sparkdl=sparkdl)


def write_sample_files(folder: str | Path, files: int) -> list[Path]:
    """The bundled digits as ``files`` Parquet files (``features: array<float>``, ``label:
    long``), modified a second apart in name order: the file source reads the oldest first."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sparkdl.apps.datasets import load_arrays

    data = load_arrays("digits")
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    written, now = [], time.time()
    for k, rows in enumerate(np.array_split(np.arange(len(data.labels)), files)):
        width = data.features.shape[1]
        values = pa.array(data.features[rows].reshape(-1))
        features = pa.FixedSizeListArray.from_arrays(values, width).cast(pa.list_(pa.float32()))
        path = target / f"digits-{k:04d}.parquet"
        pq.write_table(pa.table({"features": features, "label": pa.array(data.labels[rows])}), path)
        os.utime(path, (now - files + k, now - files + k))
        written.append(path)
    return written


def run_stream_job(config: StreamConfig, output_dir: str | Path, spark: Any | None = None) -> dict[str, Any]:
    """Train a model per micro-batch of the files at ``stream.input_path``; publish the versions.

    Writes ``metrics.json`` under ``output_dir`` (and, by default, the versions and the
    checkpoint). Returns the metrics: what each micro-batch did and the newest version.

    Raises:
        WaitTimeout: ``available_now`` did not train the files there within ``stream.timeout_s``.
        SparkDLError: the query failed (its cause named); start the job again to resume.
    """
    from sparkdl.apps.models import MLPFactory
    from sparkdl.ml.estimator import TorchEstimator
    from sparkdl.ml.streaming import StreamingFit, read_latest
    from sparkdl.spark.session import build_session

    stream = config.stream
    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if spark is None:
        spark = build_session(
            config.spark.master or None, config.spark.app_name, config.sparkdl, config.spark.conf
        )
    source = _input_location(stream)
    model_dir = stream.model_dir or str(out / "models")
    model_fn = MLPFactory(stream.input_size, stream.hidden, stream.classes, stream.dropout)
    fit = StreamingFit(
        TorchEstimator(model_fn=model_fn, config=config.sparkdl), model_dir, stream.keep_versions
    )
    reader = spark.readStream.schema(_schema(spark, stream, source))
    writer = (
        reader.option("maxFilesPerTrigger", stream.max_files_per_trigger)
        .parquet(source)
        .writeStream.foreachBatch(fit)
        .option("checkpointLocation", stream.checkpoint_location or str(out / "checkpoint"))
    )
    if stream.trigger == "available_now":
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{stream.trigger_interval_s} seconds")
    started = time.perf_counter()
    _await(writer.start(), stream)
    latest = read_latest(spark, model_dir) or {}
    metrics = {
        "input": source,
        "model_dir": model_dir,
        "batches_trained": len(fit.trained),
        "batches_skipped": len(fit.skipped),
        "batches_empty": sum(1 for r in fit.records if r.action == "empty"),
        "latest_batch_id": latest.get("batch_id"),
        "latest_version": latest.get("version"),
        "seconds": time.perf_counter() - started,
        "batches": [asdict(r) for r in fit.records],
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    log.info("trained %d micro-batches; the newest version: %s", len(fit.trained), latest.get("version"))
    return metrics


def _input_location(stream: StreamSection) -> str:
    """The directory read; a local one with no file gets the bundled digits (write_sample)."""
    location = stream.input_path
    if len(urlparse(location).scheme) > 1:
        return location
    folder = Path(location)
    if stream.write_sample and not (folder.is_dir() and any(folder.iterdir())):
        log.info("no file at %s: writing the bundled digits there as %d files", folder, stream.sample_files)
        write_sample_files(folder, stream.sample_files)
    return str(folder.resolve())


def _schema(spark: Any, stream: StreamSection, source: str) -> Any:
    """The files' schema: the setting's, else read from the files there."""
    if stream.schema:
        return stream.schema
    try:
        return spark.read.parquet(source).schema
    except Exception as exc:  # Spark's AnalysisException: no file, or none it reads as Parquet
        raise ConfigError(
            f"stream.schema is empty and no Parquet file at stream.input_path = {source!r} tells it "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]}); set stream.schema to the files' "
            "schema as Spark DDL, e.g. 'features array<float>, label long'"
        ) from exc


def _await(query: Any, stream: StreamSection) -> None:
    """Wait for ``query`` within its bound, then stop it; a failure names its cause."""
    from pyspark.errors import StreamingQueryException

    bound = stream.timeout_s if stream.trigger == "available_now" else (stream.run_for_s or None)
    try:
        ended = query.awaitTermination(bound)
    except StreamingQueryException as exc:
        raise SparkDLError(
            f"the streaming query {query.id} failed: {str(exc).splitlines()[0][:1000]}; the versions "
            "published so far are kept: fix the cause and start the job again with the same "
            "stream.checkpoint_location to go on from the batch that failed"
        ) from exc
    finally:
        query.stop()
    if stream.trigger == "available_now" and not ended:
        raise WaitTimeout(
            f"the files at {stream.input_path} were not all trained within stream.timeout_s = "
            f"{stream.timeout_s} s; the versions published so far are kept: raise stream.timeout_s, "
            "or start the job again to go on",
            setting="stream.timeout_s",
            limit_s=stream.timeout_s,
        )
