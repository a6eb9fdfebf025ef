"""The main training job: bundled data set -> fit -> held-out evaluation -> files.

``jobs/train.py`` only parses arguments and calls :func:`run_train_job`; everything
the job does is here, so notebooks and tests can call it the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkdl.apps.datasets import BUNDLED
from sparkdl.config import SparkDLConfig, config_from_tables, load_toml
from sparkdl.config.loading import about, check_bounds, override_origins
from sparkdl.errors import ConfigError, SparkDLError
from sparkdl.strategies import check_settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobSection:
    """``[job]``: the data set and the model of the main job."""

    dataset: str = field(
        default="digits",
        metadata=about(
            "Bundled data set to train on (offline).",
            valid=f"one of the bundled: {', '.join(BUNDLED)} "
            "(your own CSV/Parquet rows: jobs/etl_to_train.py)",
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
    input_partitions: int = field(
        default=4,
        metadata=about("Partitions of the input DataFrame before sparkdl repartitions it.", bound="> 0"),
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(f"job.test_fraction = {self.test_fraction} must be between 0 and 1")
        check_bounds(self, "job")


@dataclass(frozen=True)
class SparkSection:
    """``[spark]``: the session. ``master = ""`` keeps what spark-submit set."""

    master: str = field(
        default="local[2]",
        metadata=about('Spark master of the job\'s session; "" keeps what spark-submit --master set.'),
    )
    app_name: str = field(default="sparkdl-train", metadata=about("Spark application name."))
    conf: dict[str, str] = field(
        default_factory=dict,
        metadata=about(
            "Spark properties set on the session ([spark.conf] table).", valid="a table of strings"
        ),
    )


@dataclass(frozen=True)
class JobConfig:
    job: JobSection
    spark: SparkSection
    sparkdl: SparkDLConfig


def load_job_sections(
    path: str | Path, overrides: Iterable[str], own: dict[str, type[Any]]
) -> tuple[dict[str, Any], SparkDLConfig]:
    """Load a job TOML with the job's ``own`` sections, ``[spark]`` and the sparkdl ones.

    Returns the job's sections (and ``spark``) by name, and the library's config.
    """
    overrides = list(overrides)
    raw = load_toml(path, overrides)
    library = typing.get_type_hints(SparkDLConfig)
    sections = {**own, "spark": SparkSection, **library}
    built = config_from_tables(raw, str(path), sections, override_origins(overrides))
    sparkdl = check_settings(SparkDLConfig(**{name: built.pop(name) for name in library}))
    return built, sparkdl


def load_job_config(path: str | Path, overrides: Iterable[str] = ()) -> JobConfig:
    """Load a job TOML: ``[job]``, ``[spark]`` and the sparkdl sections."""
    sections, sparkdl = load_job_sections(path, overrides, {"job": JobSection})
    return JobConfig(job=sections["job"], spark=sections["spark"], sparkdl=sparkdl)


TRAIN_EPILOG = "\n".join(
    [
        "data: the job trains on a bundled data set only (offline), chosen with",
        "--set job.dataset=NAME (the config's [job] dataset); the bundled ones:",
        *(f"  {name}: {what}" for name, what in BUNDLED.items()),
        "Your own rows (CSV or Parquet files, local or on hdfs://, s3a://, dbfs:/) go through",
        "jobs/etl_to_train.py --config conf/etl.toml, with its [etl] settings: input_path,",
        "label_column, feature_sql (its --help says each).",
        "",
        "Every setting, with its default and meaning: .venv/bin/python -m sparkdl settings",
        "(docs/settings.md).",
    ]
)


def job_parser(
    description: str, defaults: tuple[str, str], advise: bool = False, epilog: str = ""
) -> argparse.ArgumentParser:
    """The argument parser of a job (see :func:`job_main`); its ``--help`` shows each default."""
    parser = argparse.ArgumentParser(
        description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=defaults[0], help="TOML config file (default: %(default)s)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting of the config file (repeatable), e.g. --set training.epochs=3 "
        "(default: none, the file's values)",
    )
    parser.add_argument(
        "--output", default=defaults[1], help="directory for the results (default: %(default)s)"
    )
    if advise:
        parser.add_argument(
            "--advise",
            action="store_true",
            help="probe the cluster and print each strategy's predicted samples/s instead of training "
            "(default: off, train)",
        )
    return parser


def job_main(
    argv: list[str] | None,
    description: str,
    defaults: tuple[str, str],
    load: Callable[[str, list[str]], Any],
    run: Callable[[Any, str], dict[str, Any]],
    summary_keys: tuple[str, ...],
    advise: Callable[[Any, str], dict[str, Any]] | None = None,
    epilog: str = "",
) -> int:
    """The command line of a job: ``--config``, repeatable ``--set``, ``--output`` (and
    ``--advise`` when the job gives an ``advise`` runner).

    ``defaults`` are the config file and output directory; ``epilog`` ends ``--help``
    (the job's data, say). Prints the metrics named by ``summary_keys`` as JSON (with
    ``--advise``: the advice's table, and the recommendation as JSON); a SparkDLError is
    one line on stderr and exit code 2.
    """
    args = job_parser(description, defaults, advise is not None, epilog).parse_args(argv)
    if advise is not None and args.advise:
        run, summary_keys = advise, ("recommended", "settings", "samples_per_s")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    from pyspark.sql import SparkSession

    session_before = SparkSession.getActiveSession()
    try:
        metrics = run(load(args.config, args.overrides), args.output)
    except SparkDLError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if session_before is None:  # only a session this job started is its to stop
            stop_job_session()
    print(json.dumps({k: metrics[k] for k in summary_keys}, indent=2))
    return 0


def stop_job_session() -> None:
    """Stop the session a job started, before the interpreter exits.

    On ``local-cluster`` the embedded cluster's workers run in this JVM; while the
    application stops they try to relaunch the executors it just released and log each
    refusal as an ERROR, which would bury a successful job's output. Those records say
    nothing wrong, so the embedded workers' logger is silenced for the stop.
    """
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is None:
        return
    sc = spark.sparkContext
    jvm: Any = sc._jvm
    if (sc.master or "").startswith("local-cluster") and jvm is not None:
        jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
            "org.apache.spark.deploy.worker", jvm.org.apache.logging.log4j.Level.OFF
        )
    spark.stop()


def run_advise_job(
    config: JobConfig,
    output_dir: str | Path,
    spark: Any | None = None,
    steps: int = 64,
    budget_s: float = 0.5,
) -> dict[str, Any]:
    """Probe the cluster with the main job's data, model and settings; print the advisor's
    table (:func:`sparkdl.advise`, ``steps`` batches per worker and ``budget_s`` timed seconds
    per candidate and pass) and write it to ``advice.json`` under ``output_dir``. Returns the
    recommendation."""
    from sparkdl.advisor.advise import advise

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    inputs = _job_inputs(config, spark)
    advice = advise(
        inputs.train_df, inputs.estimator, steps=steps, budget_s=budget_s, project_to=(8, 32, 128)
    )
    print(advice)
    (out / "advice.json").write_text(json.dumps(advice.to_dict(), indent=2))
    best = advice.recommended
    return {"recommended": best.name, "settings": dict(best.settings), "samples_per_s": best.samples_per_s}


class JobInputs(typing.NamedTuple):
    """The main job's session, training and held-out DataFrames, estimator and training rows."""

    spark: Any
    train_df: Any
    test_df: Any
    estimator: Any
    train_rows: int


def _job_inputs(config: JobConfig, spark: Any | None) -> JobInputs:
    """What the main job trains on, and with what (training and advice alike)."""
    from sparkdl.apps.datasets import load_arrays, to_dataframe, train_test_split
    from sparkdl.apps.models import MLPFactory
    from sparkdl.ml.estimator import TorchEstimator
    from sparkdl.spark.session import build_session, warm_up

    if spark is None:
        spark = build_session(
            config.spark.master or None, config.spark.app_name, config.sparkdl, config.spark.conf
        )
        warm_up(spark, config.sparkdl)  # while the data loads
    data = load_arrays(config.job.dataset)
    train, test = train_test_split(data, config.job.test_fraction, config.sparkdl.training.seed)
    train_df = to_dataframe(spark, train, config.job.input_partitions)
    test_df = to_dataframe(spark, test, config.job.input_partitions)
    model_fn = MLPFactory(train.features.shape[1], config.job.hidden, data.num_classes, config.job.dropout)
    estimator = TorchEstimator(model_fn=model_fn, config=config.sparkdl)
    return JobInputs(spark, train_df, test_df, estimator, len(train.labels))


def run_train_job(config: JobConfig, output_dir: str | Path, spark: Any | None = None) -> dict[str, Any]:
    """Train on the bundled data set, evaluate on the held-out split, write the results.

    Writes ``metrics.json``, ``history.png`` (loss and samples/s per epoch) and the
    saved model (``model/``) under ``output_dir``.
    Returns the metrics.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    inputs = _job_inputs(config, spark)
    started = time.perf_counter()
    model = inputs.estimator.fit(inputs.train_df)
    fit_seconds = time.perf_counter() - started
    # the progress lines already showed each epoch: then these go to the debug log only
    level = logging.DEBUG if config.sparkdl.runtime.progress else logging.INFO
    for record in model.history:
        log.log(
            level,
            "epoch %d: loss %.4f, %d samples, %.0f samples/s (%s)",
            record["epoch"],
            record["loss"],
            record["samples"],
            record["samples_per_s"],
            record["source"],
        )
    predictions = (
        model.transform(inputs.test_df).select("label", config.sparkdl.data.prediction_col).collect()
    )
    correct = sum(int(row[0] == row[1]) for row in predictions)
    metrics = {
        "dataset": config.job.dataset,
        "train_rows": inputs.train_rows,
        "test_rows": len(predictions),
        "test_accuracy": correct / max(len(predictions), 1),
        "final_loss": model.history[-1]["loss"],
        "fit_seconds": fit_seconds,
        "history": model.history,
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.sparkdl.flat_shown().items()},
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
