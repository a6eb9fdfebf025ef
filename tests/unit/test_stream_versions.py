"""A stream's published versions kept to the newest ``keep_versions`` (no Spark: local
paths), and the files a dead writer half wrote taken as absent."""

from __future__ import annotations

import json

import pytest

from sparkdl import ConfigError, StreamingFit, TorchEstimator
from sparkdl.ml.streaming import read_latest, read_manifest, version_path
from tests.reference import make_tiny_net


def _publish_by_hand(model_dir, batch_id, manifest=True):
    folder = model_dir / f"batch-{batch_id:012d}"
    folder.mkdir(parents=True)
    (folder / "weights.pt").write_bytes(b"w" * 10)
    if manifest:
        (folder / "_PUBLISHED.json").write_text(json.dumps({"batch_id": batch_id, "query_id": "q"}))


def test_pruning_keeps_the_newest_published_versions_and_what_is_newer(tmp_path):
    models = tmp_path / "models"
    for batch_id in (0, 1, 2, 4, 5):
        _publish_by_hand(models, batch_id)
    _publish_by_hand(models, 3, manifest=False)  # its fit died before the manifest: replayed later
    _publish_by_hand(models, 6, manifest=False)  # in flight (a fit saving now): never touched
    fit = StreamingFit(TorchEstimator(model_fn=make_tiny_net), str(models), keep_versions=2)
    assert fit.prune(None) == [0, 1, 2, 3]
    assert sorted(p.name for p in models.iterdir()) == [
        "batch-000000000004",
        "batch-000000000005",
        "batch-000000000006",
    ]
    assert read_manifest(None, version_path(str(models), 5)) == {"batch_id": 5, "query_id": "q"}
    assert fit.prune(None) == []  # nothing more to remove
    assert StreamingFit(TorchEstimator(model_fn=make_tiny_net), str(models)).prune(None) == []  # 0 keeps all
    with pytest.raises(ConfigError, match="keep_versions = -1"):
        StreamingFit(TorchEstimator(model_fn=make_tiny_net), str(models), keep_versions=-1)


def test_a_half_written_latest_falls_back_to_the_newest_manifest(tmp_path):
    models = tmp_path / "models"
    _publish_by_hand(models, 7)
    _publish_by_hand(models, 9, manifest=False)
    (models / "LATEST").write_bytes(b'{"batch_id": 9, "vers')  # a writer died mid-file
    assert read_latest(None, str(models)) == {"batch_id": 7, "version": "batch-000000000007", "query_id": "q"}
    assert read_latest(None, str(tmp_path / "nothing")) is None
