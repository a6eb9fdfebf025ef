"""The jobs' ``--help``: every option's default, the bundled data, the way to one's own data."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from sparkdl import ConfigError
from sparkdl.apps.datasets import BUNDLED, load_arrays

ROOT = Path(__file__).resolve().parents[2]


def _job(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"job_{name}", ROOT / "jobs" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _help(name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(sys, "path", list(sys.path))  # a job puts the repository first on it
    with pytest.raises(SystemExit) as done:
        _job(name).main(["--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width


def test_the_train_jobs_help_shows_each_default_and_the_bundled_data(capsys, monkeypatch):
    text = _help("train", capsys, monkeypatch)
    assert "--config CONFIG TOML config file (default: conf/local.toml)" in text
    assert "directory for the results (default: out/train)" in text
    assert "(default: none, the file's values)" in text  # --set
    assert "(default: off, train)" in text  # --advise
    assert "the job trains on a bundled data set only" in text
    assert "--set job.dataset=NAME" in text
    assert "digits: scikit-learn's 1,797 8x8 handwritten digits" in text
    assert "Your own rows (CSV or Parquet files" in text
    assert "jobs/etl_to_train.py --config conf/etl.toml, with its [etl] settings" in text


def test_the_etl_jobs_help_shows_each_default_and_what_it_reads(capsys, monkeypatch):
    text = _help("etl_to_train", capsys, monkeypatch)
    assert "TOML config file (default: conf/etl.toml)" in text
    assert "directory for the results (default: out/etl)" in text
    for setting in ("input_path", "input_format", "label_column", "feature_columns", "feature_sql"):
        assert f"--set etl.{setting}=" in text
    assert "csv (with a header row) or parquet" in text
    assert "conf/etl.toml's keeps the rows with a digit, so set your own" in text  # its feature_sql


def test_the_streaming_jobs_help_shows_each_default_and_what_it_watches(capsys, monkeypatch):
    text = _help("stream_train", capsys, monkeypatch)
    assert "TOML config file (default: conf/stream.toml)" in text
    assert "directory for the results (default: out/stream)" in text
    for setting in ("input_path", "schema", "trigger"):
        assert f"--set stream.{setting}=" in text
    assert "same stream.checkpoint_location" in text


def test_the_bundled_data_sets_are_the_ones_that_load():
    for name in BUNDLED:
        assert len(load_arrays(name).labels) > 0
    with pytest.raises(ConfigError) as info:
        load_arrays("mnist")
    assert str(info.value) == (
        "job.dataset = 'mnist' is not bundled; choose one of 'digits', "
        "or train on your own CSV/Parquet rows with jobs/etl_to_train.py"
    )


def test_stream_config_errors_name_the_setting():
    from sparkdl.apps.stream_job import load_stream_config

    with pytest.raises(
        ConfigError, match=r"stream\.trigger = 'once'; use one of available_now, processing_time"
    ):
        load_stream_config(ROOT / "conf/stream.toml", ["stream.trigger=once"])
    with pytest.raises(ConfigError, match=r"stream\.max_files_per_trigger = 0 must be > 0"):
        load_stream_config(ROOT / "conf/stream.toml", ["stream.max_files_per_trigger=0"])
    config = load_stream_config(ROOT / "conf/stream.toml", [])
    assert config.stream.schema == "features array<float>, label long" and config.sparkdl.training.epochs == 3
