"""MLflow logs a model that does not export as pt2 without pickling it, unless asked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparkdl.ml.estimator import TorchModel
from sparkdl.ml.tracking import _log_model


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
