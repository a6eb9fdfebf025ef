"""What a user sees around a fit: live progress, worker warnings, MLflow, the history plot."""

from __future__ import annotations

import logging
import re
import time

import numpy as np
import pytest
import torch

from tests.reference import make_shards, make_tiny_net
from tests.spark.test_fit import estimator, shards_dataframe

pytestmark = pytest.mark.spark


def slow_loss(output, target):
    """Cross entropy taking 25 ms a step more: epochs long enough to time."""
    time.sleep(0.025)
    return torch.nn.functional.cross_entropy(output, target.long())


def epoch_lines(err: str) -> list[str]:
    return [line for line in err.replace("\r", "\n").splitlines() if line.startswith("epoch ")]


def line_seconds(line: str) -> float:
    match = re.search(r", (\d+\.\d)s, ", line)
    assert match, line
    return float(match.group(1))


def test_a_fit_without_a_terminal_tells_each_phase_and_each_epoch_in_one_line_and_a_quiet_one_nothing(
    spark, capsys
):
    """Before training, what runs (the checks, the workers' start); one line per epoch with
    the seconds the workers measured, within 20% of history's; one summary line at the end."""
    df = shards_dataframe(spark, make_shards([96, 96]))
    model = estimator(epochs=3, progress_interval_s=0.05, loss_fn=slow_loss).fit(df)
    err = capsys.readouterr().err  # captured: no terminal redraws a bar
    lines = epoch_lines(err)
    assert [line.split(":")[0] for line in lines] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"], lines
    # every epoch ends full (12 steps: 96 rows / 8 per step), epoch 1 too, whose length streamed
    assert all(line.split(": ")[1].startswith("12/12 steps, ") for line in lines), lines
    assert all(re.search(r", loss=\d+\.\d{4}, samples_s=[\d,]+$", line) for line in lines), lines
    for line, record in zip(lines, model.history, strict=True):
        assert line_seconds(line) == pytest.approx(record["seconds"], rel=0.2, abs=0.05), (line, record)
    said = [
        line
        for line in err.splitlines()
        if line.startswith("sparkdl: ") and "no worker started yet" not in line
    ]
    assert said[0].startswith("sparkdl: checking before training"), said
    assert said[1].startswith("sparkdl: starting 2 workers"), said
    assert said[2].startswith("sparkdl: all 2 workers started, "), said
    assert said[-1].startswith("sparkdl: 3 epochs trained in "), said
    assert f"36 steps, {3 * 192} samples" in said[-1], said
    estimator(epochs=2, progress=False).fit(df)
    assert "epoch 1/2" not in (quiet := capsys.readouterr().err) and "sparkdl: " not in quiet


def timed_loop(ctx, per_step: bool):
    """The README's loop, each step 25 ms slower, timing its own epochs; reporting the loss
    every step, or once an epoch after its batches (its mean)."""
    model = make_tiny_net()
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for epoch in ctx.epochs:
        started, losses = time.perf_counter(), []
        for batch in ctx.batches(epoch):
            (x,) = batch.inputs.values()
            loss = torch.nn.functional.cross_entropy(model(x), batch.label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if per_step:
                ctx.report(loss=loss.item())
            time.sleep(0.025)
        seconds = time.perf_counter() - started
        if per_step:
            ctx.report(epoch_seconds=seconds)
        else:  # after the batches: sent at once (before: held back by the report interval)
            ctx.report(loss=sum(losses) / len(losses), epoch_seconds=seconds)


@pytest.mark.parametrize("per_step", [True, False], ids=["loss every step", "loss after each epoch"])
def test_an_own_loops_progress_ends_each_epoch_with_its_real_figures_and_the_run_with_a_summary(
    spark, capsys, per_step
):
    """Before: the epoch's line held the last rate-limited report (10 of 12 steps; epoch 3's
    never written) and the driver's seconds since its first report; nothing after the run."""
    import sparkdl

    df = shards_dataframe(spark, make_shards([96, 96]))
    result = sparkdl.run(
        timed_loop, per_step, df=df, num_workers=2, batch_size=8, epochs=3, progress_interval_s=0.2
    )
    err = capsys.readouterr().err
    lines = epoch_lines(err)
    assert [line.split(":")[0] for line in lines] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"], lines
    assert all(line.split(": ")[1].startswith("12/12 steps, ") for line in lines), lines
    measured = [h["epoch_seconds"] for h in result.history if "epoch_seconds" in h]
    for line, seconds in zip(lines, measured, strict=True):
        assert line_seconds(line) == pytest.approx(seconds, rel=0.2, abs=0.05), (line, seconds)
    # the loss over the epoch's rows, from the reported losses: rank 0's reports of epoch 3
    losses = [h["loss"] for h in result.history if h["epoch"] == 3 and "loss" in h]
    assert float(re.search(r"loss=(\d+\.\d+)", lines[2]).group(1)) == pytest.approx(
        sum(losses) / len(losses), abs=0.05
    )
    said = [
        line
        for line in err.splitlines()
        if line.startswith("sparkdl: ") and "no worker started yet" not in line
    ]
    assert said[0] == "sparkdl: reading the first rows (a Spark job)", said
    assert said[1].startswith("sparkdl: starting 2 workers"), said
    assert said[-1].startswith("sparkdl: 3 epochs trained in "), said


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
