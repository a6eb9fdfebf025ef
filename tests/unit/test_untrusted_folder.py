"""Loading a model or estimator from a folder someone else wrote: the settings that decide
what is trusted, written where or sent in the clear stay at their defaults (with a warning
naming what was ignored), and a weights or pickle file that is a symlink out of the folder
is refused.

The readers run as they do under ``TorchModel.load``; only Spark's reading of the metadata
file (``spark.read.text``) is replaced by reading the same JSON line here, so no
SparkSession is started. The folders are copies of the 0.1 fixture
(tests/fixtures/saved_by_0_1), saved by sparkdl with default security settings.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from sparkdl import TorchEstimator, TorchModel
from sparkdl.errors import ConfigError
from sparkdl.ml.persistence import TorchEstimatorReader, TorchModelReader
from tests.reference import make_tiny_net

SAVED = Path(__file__).resolve().parents[1] / "fixtures" / "saved_by_0_1"
NO_SPARK: Any = object()  # local paths: the readers never touch the session
EDITED = {
    "encrypt": True,
    "mlflow_pickle_model": True,
    "checkpoint_dir": "/tmp/theirs",
    "checkpoint_every": 5,
}


@pytest.fixture(autouse=True)
def metadata_without_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspark.ml.util import DefaultParamsReader

    def load_metadata(path: str, sc: Any, expectedClassName: str = "") -> dict[str, Any]:
        text = next(Path(path, "metadata").glob("part-*")).read_text()
        return DefaultParamsReader._parseMetaData(text, expectedClassName)

    monkeypatch.setattr(DefaultParamsReader, "loadMetadata", staticmethod(load_metadata))


def _copy(name: str, tmp_path: Path, edits: dict[str, Any] | None = None) -> Path:
    """A copy of the fixture's ``name`` folder, its paramMap updated with ``edits``."""
    folder = Path(shutil.copytree(SAVED / name, tmp_path / name))
    part = next((folder / "metadata").glob("part-*"))
    metadata = json.loads(part.read_text())
    metadata["paramMap"].update(edits or {})
    part.write_text(json.dumps(metadata))
    return folder


def _load_model(folder: Path, trust_pickle: bool = False) -> TorchModel:
    model_fn = None if trust_pickle else make_tiny_net
    reader = TorchModelReader(TorchModel, model_fn=model_fn, trust_pickle=trust_pickle)
    return reader.session(NO_SPARK).load(str(folder))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_model_saved_with_default_settings_loads_without_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        model = _load_model(_copy("model", tmp_path))
    assert _warnings(caplog) == []
    assert model.getOrDefault("batch_size") == 8  # the other settings are still the saved ones


def test_a_model_folder_does_not_choose_encryption_pickling_or_checkpoints(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        model = _load_model(_copy("model", tmp_path, EDITED))
    config = model.get_config()
    assert config.runtime.encrypt is False
    assert config.tracking.mlflow_pickle_model is False
    assert (config.reliability.checkpoint_dir, config.reliability.checkpoint_every) == ("", 0)
    assert model.getOrDefault("batch_size") == 8
    (message,) = _warnings(caplog)
    for shown in (
        "runtime.encrypt = True",
        "tracking.mlflow_pickle_model = True",
        "reliability.checkpoint_dir = '/tmp/theirs'",
        "model.set(model.encrypt, True)",
        "model.set(model.checkpoint_dir, '/tmp/theirs')",
    ):
        assert shown in message


def test_a_saved_default_param_map_does_not_choose_them_either(tmp_path, caplog):
    folder = _copy("model", tmp_path)
    part = next((folder / "metadata").glob("part-*"))
    metadata = json.loads(part.read_text())
    metadata["defaultParamMap"]["cache_dir"] = "/tmp/theirs"
    part.write_text(json.dumps(metadata))
    with caplog.at_level(logging.WARNING):
        model = _load_model(folder)
    assert model.getOrDefault("cache_dir") == ""
    assert "data.cache_dir = '/tmp/theirs'" in _warnings(caplog)[0]


def test_an_estimator_folder_does_not_choose_them(tmp_path, caplog):
    folder = _copy("estimator", tmp_path, EDITED)
    with caplog.at_level(logging.WARNING):
        estimator = (
            TorchEstimatorReader(TorchEstimator, model_fn=make_tiny_net).session(NO_SPARK).load(str(folder))
        )
    assert (estimator.getOrDefault("encrypt"), estimator.getOrDefault("checkpoint_dir")) == (False, "")
    assert estimator.getOrDefault("mlflow_pickle_model") is False
    assert estimator.getOrDefault("epochs") == 1
    assert "estimator.set(estimator.mlflow_pickle_model, True)" in _warnings(caplog)[0]


def test_weights_symlinked_out_of_the_folder_are_refused(tmp_path):
    folder = _copy("model", tmp_path / "saved")
    outside = tmp_path / "elsewhere.pt"
    shutil.move(folder / "weights.pt", outside)
    (folder / "weights.pt").symlink_to(outside)
    with pytest.raises(
        ConfigError, match=r"weights\.pt is a symlink to .*elsewhere\.pt.*cp --remove-destination"
    ):
        _load_model(folder)


def test_weights_symlinked_within_the_folder_load(tmp_path):
    folder = _copy("model", tmp_path)
    (folder / "weights.pt").rename(folder / "kept.pt")
    (folder / "weights.pt").symlink_to("kept.pt")
    model = _load_model(folder)
    expected = torch.load(folder / "kept.pt", weights_only=True)
    assert torch.equal(model.module.state_dict()["body.0.weight"], expected["body.0.weight"])


def test_a_trusted_pickle_symlinked_out_of_the_folder_is_refused(tmp_path):
    folder = _copy("model", tmp_path / "saved")
    outside = tmp_path / "elsewhere.cloudpickle"
    shutil.move(folder / "model_fn.cloudpickle", outside)
    (folder / "model_fn.cloudpickle").symlink_to(outside)
    with pytest.raises(ConfigError, match=r"model_fn\.cloudpickle is a symlink to"):
        _load_model(folder, trust_pickle=True)
