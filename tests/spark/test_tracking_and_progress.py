"""What a user sees around a fit: live progress, worker warnings, MLflow, the history plot."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch

from tests.reference import make_shards
from tests.spark.test_fit import estimator, shards_dataframe

pytestmark = pytest.mark.spark


def test_a_fit_without_a_terminal_writes_one_line_per_epoch_and_a_quiet_one_none(spark, capsys):
    df = shards_dataframe(spark, make_shards([96, 96]))
    estimator(epochs=2, progress_interval_s=0.01).fit(df)
    err = capsys.readouterr().err.replace("\r", "\n")  # captured: no terminal redraws a bar
    lines = [line for line in err.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1/2", "epoch 2/2"], lines
    # epoch 2 knows its length (12 steps: 96 rows / 8 per step) and ends full
    assert lines[1].startswith("epoch 2/2: 12/12 steps, "), lines
    assert all(re.search(r", loss=\d+\.\d{4}, samples_s=[\d,]+$", line) for line in lines), lines
    estimator(epochs=2, progress=False).fit(df)
    assert "epoch 1/2" not in capsys.readouterr().err


def warning_loss(output, target):
    """Cross entropy that logs a warning from inside the worker on its first call."""
    if not getattr(warning_loss, "warned", False):
        warning_loss.warned = True
        logging.getLogger("sparkdl.user_code").warning("label smoothing is off (from the loss)")
    return torch.nn.functional.cross_entropy(output, target.long())


def test_worker_warnings_reach_the_driver_log_with_their_rank(spark, caplog):
    df = shards_dataframe(spark, make_shards([32, 32]))
    with caplog.at_level(logging.WARNING, logger="sparkdl.worker"):
        estimator(loss_fn=warning_loss, progress=False).fit(df)
    lines = [r.getMessage() for r in caplog.records if r.name == "sparkdl.worker"]
    for rank in (0, 1):
        assert f"[rank {rank}] sparkdl.user_code: label smoothing is off (from the loss)" in lines


def test_mlflow_logs_params_epoch_metrics_and_a_loadable_model(spark, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store opt-in
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    shards = make_shards([48, 48])
    model = estimator(epochs=3, progress=False, mlflow_experiment="sparkdl-test", validation=0.25).fit(
        shards_dataframe(spark, shards)
    )
    assert model.mlflow_run_id
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(model.mlflow_run_id)
    assert run.data.params["strategy"] == "allreduce" and run.data.params["batch_size"] == "8"
    losses = client.get_metric_history(model.mlflow_run_id, "loss")
    assert [(m.step, m.value) for m in sorted(losses, key=lambda m: m.step)] == [
        (h["epoch"], pytest.approx(h["loss"])) for h in model.history
    ]
    val = client.get_metric_history(model.mlflow_run_id, "val_accuracy")
    assert sorted((m.step, m.value) for m in val) == [
        (h["epoch"], pytest.approx(h["val_accuracy"])) for h in model.history
    ]
    logged = mlflow.pytorch.load_model(f"runs:/{model.mlflow_run_id}/model")
    x = torch.tensor(np.asarray(shards[0][0][:5], dtype=np.float32))
    with torch.no_grad():
        expected = model.module.eval()(x)
        got = logged(x) if callable(logged) else logged.module()(x)
    assert torch.allclose(torch.as_tensor(got), expected)


def test_without_a_tracking_uri_nothing_is_logged(spark, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    model = estimator(progress=False).fit(shards_dataframe(spark, make_shards([16, 16])))
    assert model.mlflow_run_id is None
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow.db").exists()
