"""MLflow: a model that does not export as pt2 is logged without pickling it unless asked, a store
MLflow refuses fails before training, and a failure while logging keeps the trained model."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from torch import nn

from sparkdl.config import SparkDLConfig
from sparkdl.errors import ConfigError
from sparkdl.ml.estimator import TorchModel
from sparkdl.spark.tracking import _log_model, check_tracking, log_fit


class DataDependent(nn.Module):
    """A model torch.export cannot trace: its control flow depends on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        if out.sum() > 0:  # data-dependent branch
            return out * 2
        return out


@pytest.mark.parametrize("pickle", [False, True])
def test_a_model_that_does_not_export_is_logged_pickled_only_when_asked(tmp_path, monkeypatch, pickle):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    module = DataDependent()
    model = TorchModel(module=module, model_fn=DataDependent, trained_input_shapes={"features": (4,)})
    with mlflow.start_run() as run:
        _log_model(mlflow, model, pickle=pickle)
    client = mlflow.tracking.MlflowClient()
    artifacts = {f.path for f in client.list_artifacts(run.info.run_id)}
    x = torch.randn(3, 4)
    if pickle:
        logged = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
        assert torch.equal(logged(x), module(x)) and "model_weights" not in artifacts
    else:
        with pytest.raises(mlflow.exceptions.MlflowException):  # no model was logged, pickled or not
            mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
        assert artifacts == {"model_weights"}
        local = client.download_artifacts(run.info.run_id, "model_weights/weights.pt", str(tmp_path))
        state = torch.load(local, weights_only=True)
        assert all(torch.equal(state[k], v) for k, v in module.state_dict().items())


def test_a_file_store_mlflow_refuses_fails_before_training_naming_the_uri_and_the_fix(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError) as refused:
        check_tracking(SparkDLConfig())
    message = str(refused.value)
    assert f"tracking URI {uri!r}" in message
    assert "set the environment variable MLFLOW_ALLOW_FILE_STORE=true" in message
    assert "or set mlflow = false" in message
    # MLflow's own text whole: its link and its opt-out were cut at 300 characters before
    assert "https://mlflow.org/docs/latest/self-hosting/migrate-from-file-store " in message
    assert "to opt out of this exception." in message
    check_tracking(SparkDLConfig().replace(mlflow=False))  # not logging: nothing to check
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_tracking(SparkDLConfig())  # the same store, opted in
    assert mlflow.MlflowClient().search_experiments(max_results=1)  # it opened the real store


def test_a_database_store_without_the_full_mlflow_package_says_which_package(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        mlflow.MlflowClient().search_experiments(max_results=1)
    except Exception:
        with pytest.raises(ConfigError, match=r"a sqlite: store needs the full MLflow package \(pip install"):
            check_tracking(SparkDLConfig())
    else:  # the full package is installed: sqlite works, and so does the check
        check_tracking(SparkDLConfig())


def test_a_failure_while_logging_a_trained_model_warns_and_keeps_it(tmp_path, monkeypatch, caplog):
    pytest.importorskip("mlflow")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_tracking(SparkDLConfig())  # passed before training ...
    store = tmp_path / "mlruns"
    shutil.rmtree(store)
    store.write_text("a file where the store's directory was")  # ... and is broken after it
    model = TorchModel(module=nn.Linear(4, 3), model_fn=lambda: nn.Linear(4, 3))
    with caplog.at_level(logging.WARNING, logger="sparkdl.spark.tracking"):
        assert log_fit(SparkDLConfig(), model, fit_seconds=1.0) is None
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "sparkdl.spark.tracking"]
    assert f"the fit was trained but logging it to {uri} failed (" in warning
    assert "save it with model.save(path)" in warning


def test_a_long_mlflow_reason_is_cut_at_a_space_never_inside_a_link():
    from sparkdl.spark.tracking import _reason

    link = "https://example.com/" + "x" * 40
    reason = _reason(RuntimeError(("see " + link + " ") * 40 + "\nsecond line"))
    assert reason.endswith(" ...") and len(reason) <= 1_004
    assert all(word in ("see", link, "...") for word in reason.split())  # every link whole
    assert _reason(RuntimeError("")) == "RuntimeError."


def test_a_fit_in_a_trial_thread_logs_a_run_nested_under_the_tuning_run_of_the_caller(tmp_path, monkeypatch):
    """pyspark.ml's tuning fits each trial in a pool thread while the thread that called
    cv.fit holds the tuning run; MLflow keeps the active run per thread, so before, every
    trial logged a top-level run. Two runs held elsewhere: which one is ambiguous, top-level."""
    import threading

    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    model = TorchModel(module=nn.Linear(4, 3), model_fn=lambda: nn.Linear(4, 3), history=[])

    def trial_run() -> str:
        logged: list[str] = []
        thread = threading.Thread(target=lambda: logged.append(log_fit(SparkDLConfig(), model, 1.0)))
        thread.start()
        thread.join(60)
        return logged[0]

    client = mlflow.tracking.MlflowClient()
    with mlflow.start_run(run_name="tuning") as tuning:
        trials = [trial_run() for _ in range(2)]
        # two trials at once, each inside its own run while the other starts: neither is the
        # other's parent, nor makes the tuning run's parentage ambiguous
        both_inside = threading.Barrier(2, timeout=30)
        log_params = mlflow.log_params

        def logging_together(params):
            log_params(params)
            both_inside.wait()

        monkeypatch.setattr(mlflow, "log_params", logging_together)
        together: list[str] = []
        pair = [
            threading.Thread(target=lambda: together.append(log_fit(SparkDLConfig(), model, 1.0)))
            for _ in "ab"
        ]
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join(60)
        monkeypatch.setattr(mlflow, "log_params", log_params)
        trials += together
    assert len(trials) == 4
    for run_id in trials:
        run = client.get_run(run_id)
        assert run.data.tags["mlflow.parentRunId"] == tuning.info.run_id
        assert run.info.experiment_id == tuning.info.experiment_id
    assert mlflow.active_run() is None  # the caller's thread left as it was

    other_holds = threading.Event()
    release = threading.Event()

    def hold_another_run() -> None:
        with mlflow.start_run(run_name="elsewhere"):
            other_holds.set()
            release.wait(60)

    holder = threading.Thread(target=hold_another_run)
    holder.start()
    other_holds.wait(60)
    try:
        with mlflow.start_run(run_name="tuning"):
            ambiguous = trial_run()
    finally:
        release.set()
        holder.join(60)
    assert "mlflow.parentRunId" not in client.get_run(ambiguous).data.tags
