"""jobs/etl_to_train.py end to end: raw files -> SQL feature steps -> fit -> Parquet predictions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkdl.apps.etl_job import load_etl_config, run_etl_job, write_sample_input

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.spark


def test_the_etl_job_reads_parquet_and_writes_predictions_a_reloadable_pipeline_reproduces(spark, tmp_path):
    from pyspark.ml import PipelineModel

    raw_path = write_sample_input(tmp_path / "raw/digits.parquet", "parquet")
    config = load_etl_config(
        ROOT / "conf/etl.toml",
        [
            f"etl.input_path={raw_path}",
            "etl.input_format=parquet",
            "etl.write_sample=false",
            # the SQL step really runs: it drops the rows of one digit
            "etl.feature_sql=SELECT * FROM __THIS__ WHERE digit <> 'nine'",
            "training.epochs=8",
        ],
    )
    metrics = run_etl_job(config, tmp_path / "out", spark=spark)
    assert metrics["classes"] == 10 and metrics["feature_columns"] == 64
    assert metrics["test_accuracy"] >= 0.9
    predictions = spark.read.parquet(str(tmp_path / "out/predictions"))
    assert predictions.columns == ["digit", "predicted_digit", "label", "prediction"]
    assert predictions.count() == metrics["test_rows"]
    assert predictions.filter("digit = 'nine'").count() == 0
    assert (
        json.loads((tmp_path / "out/metrics.json").read_text())["test_accuracy"] == metrics["test_accuracy"]
    )
    assert (tmp_path / "out/history.png").stat().st_size > 0

    # The saved pipeline replays every step on raw rows: same predictions as the job wrote.
    from sparkdl import loading
    from sparkdl.apps.models import MLPFactory

    architecture = MLPFactory(64, config.etl.hidden, 10, config.etl.dropout)
    with loading(model_fn=architecture):
        reloaded = PipelineModel.load(str(tmp_path / "out/pipeline"))
    raw = spark.read.parquet(str(raw_path)).limit(50)
    again = {tuple(r) for r in reloaded.transform(raw).select("digit", "label", "prediction").collect()}
    correct = sum(1 for _, label, prediction in again if label == prediction)
    assert correct / len(again) >= 0.85


def test_the_etl_command_writes_a_sample_csv_when_there_is_no_input(spark, tmp_path, monkeypatch, capsys):
    import jobs.etl_to_train as cli

    monkeypatch.chdir(tmp_path)
    code = cli.main(
        ["--config", str(ROOT / "conf/etl.toml"), "--set", "training.epochs=3", "--output", "out"]
    )
    assert code == 0
    assert (tmp_path / "data/raw/digits.csv").read_text().startswith('"pixel_0","pixel_1"')
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{") :])
    metrics = json.loads((tmp_path / "out/metrics.json").read_text())
    assert summary["test_accuracy"] == metrics["test_accuracy"] > 0.8
    assert metrics["test_rows"] > 300


def test_etl_config_errors_name_the_setting(tmp_path):
    from sparkdl import ConfigError

    with pytest.raises(ConfigError, match=r"etl\.input_format = 'json'"):
        load_etl_config(ROOT / "conf/etl.toml", ["etl.input_format=json"])
    with pytest.raises(ConfigError, match="FROM __THIS__"):
        load_etl_config(ROOT / "conf/etl.toml", ["etl.feature_sql=SELECT 1"])
