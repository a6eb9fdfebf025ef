"""Structured Streaming trains a model incrementally (issue 56 item 3): a file-source stream
over a directory of Parquet files, one file per micro-batch, publishes a version per batch id
(each loads and predicts, each starts from the one before); a query killed after publishing a
batch, and one whose fit dies before publishing, restart from their checkpoint location to the
weights of the same batches fitted one after another by hand, no batch lost or trained twice."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkdl import ConfigError, StreamingFit, TorchModel, latest_model
from sparkdl.ml.streaming import read_latest, read_manifest, version_path
from tests import object_store
from tests.reference import make_shards, make_tiny_net, max_abs_diff, shard_to_batch
from tests.spark.test_fit import estimator

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[2]

SCHEMA = "features array<float>, label long"
ROWS = 24  # per file: one micro-batch each (maxFilesPerTrigger = 1)


def stream_estimator(**settings):
    return estimator(num_workers=1, progress=False, **settings)


def write_batch_files(folder, count):
    """``count`` Parquet files of ``ROWS`` rows, modified one second apart in name order (the
    file source takes the oldest first)."""
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for k in range(count):
        path = folder / f"part-{k:03d}.parquet"
        pq.write_table(pa.Table.from_batches([shard_to_batch(*make_shards([ROWS], seed=100 + k)[0])]), path)
        os.utime(path, (now - 60 + k, now - 60 + k))
    return sorted(folder.iterdir())


def run_stream(spark, source, checkpoint, function, timeout_s=180.0):
    """Train every file in ``source`` (available now) through ``function``; raise what it raised."""
    query = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .parquet(str(source))
        .writeStream.foreachBatch(function)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert query.awaitTermination(timeout_s), f"the stream did not end within {timeout_s} s"
    finally:
        query.stop()


def test_a_stream_publishes_a_version_per_batch_each_loading_and_predicting(spark, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    files = write_batch_files(tmp_path / "in", 2)
    models = str(tmp_path / "models")
    fit = StreamingFit(stream_estimator(mlflow_log_model=False), models)
    run_stream(spark, tmp_path / "in", tmp_path / "checkpoint", fit)
    assert fit.trained == [0, 1] and fit.skipped == []

    client = mlflow.MlflowClient()
    for k, file in enumerate(files):
        version = version_path(models, k)
        manifest = read_manifest(spark, version)
        assert manifest["batch_id"] == k and manifest["samples"] == ROWS
        assert manifest["initial_model"] == (version_path(models, k - 1) if k else "")  # from the one before
        run = client.get_run(manifest["mlflow_run_id"])
        assert run.data.tags["sparkdl.batch_id"] == str(k)
        assert run.data.tags["sparkdl.model_version"] == version
        assert run.info.run_name == f"stream batch {k}"
        model = TorchModel.load(version, model_fn=make_tiny_net)
        assert model.transform(spark.read.parquet(str(file))).select("prediction").count() == ROWS
    latest = read_latest(spark, models)
    assert {k: latest[k] for k in ("batch_id", "version")} == {"batch_id": 1, "version": "batch-000000000001"}
    assert latest["query_id"] == read_manifest(spark, version_path(models, 0))["query_id"] != ""
    newest = latest_model(models, model_fn=make_tiny_net)
    assert (
        max_abs_diff(
            newest.module.state_dict(),
            TorchModel.load(version_path(models, 1), model_fn=make_tiny_net).module.state_dict(),
        )
        == 0.0
    )

    fit(spark.createDataFrame([], SCHEMA), 2)  # an empty micro-batch: no fit, no version
    assert fit.records[-1].action == "empty" and read_latest(spark, models)["batch_id"] == 1
    assert not os.path.exists(version_path(models, 2))


class DiesBeforePublishing(StreamingFit):
    """Dies once, on ``batch``, after the model's files are saved and before its manifest."""

    def __init__(self, estimator, model_dir, batch):
        super().__init__(estimator, model_dir)
        self.batch = batch

    def mark_published(self, spark, model, batch_id, fit_seconds):
        if batch_id == self.batch:
            raise RuntimeError(f"the driver died before publishing micro-batch {batch_id}")
        super().mark_published(spark, model, batch_id, fit_seconds)


def test_a_query_restarted_from_its_checkpoint_trains_every_batch_once(spark, tmp_path):
    from pyspark.errors import StreamingQueryException

    files = write_batch_files(tmp_path / "in", 3)
    models, checkpoint = str(tmp_path / "models"), tmp_path / "checkpoint"

    # 1. Killed right after publishing batch 1: Spark never commits it.
    first = StreamingFit(stream_estimator(), models)

    def killed_after_publishing_1(batch_df, batch_id):
        first(batch_df, batch_id)
        if batch_id == 1:
            raise RuntimeError("killed after publishing micro-batch 1")

    with pytest.raises(StreamingQueryException, match="killed after publishing micro-batch 1"):
        run_stream(spark, tmp_path / "in", checkpoint, killed_after_publishing_1)
    assert first.trained == [0, 1]

    # 2. Restarted (a new driver): batch 1 is replayed and skipped; batch 2's fit dies before
    #    its manifest, leaving its files but no version.
    second = DiesBeforePublishing(stream_estimator(), models, batch=2)
    with pytest.raises(StreamingQueryException, match="died before publishing micro-batch 2"):
        run_stream(spark, tmp_path / "in", checkpoint, second)
    assert second.skipped == [1] and second.trained == []
    assert os.path.exists(f"{version_path(models, 2)}/weights.pt")
    assert read_manifest(spark, version_path(models, 2)) is None
    assert read_latest(spark, models)["batch_id"] == 1

    # 3. Restarted again: batch 2 is trained, from version 1.
    third = StreamingFit(stream_estimator(), models)
    run_stream(spark, tmp_path / "in", checkpoint, third)
    assert third.trained == [2] and third.skipped == []
    assert read_manifest(spark, version_path(models, 2))["initial_model"] == version_path(models, 1)

    # The same batches fitted one after another by hand: the same weights.
    model = None
    for file in files:
        model = stream_estimator(initial_model=model).fit(spark.read.parquet(str(file)))
    streamed = latest_model(models, model_fn=make_tiny_net)
    assert max_abs_diff(streamed.module.state_dict(), model.module.state_dict()) < 1e-6

    # 4. A new query (a new checkpoint location) on the same model_dir: its batch 0 is not
    #    taken for a replay of the old query's batch 0 and skipped, it is refused.
    fourth = StreamingFit(stream_estimator(), models)
    with pytest.raises(StreamingQueryException, match="holds the versions of streaming query"):
        run_stream(spark, tmp_path / "in", tmp_path / "another-checkpoint", fourth)
    assert fourth.records == []


def test_a_model_dir_written_by_another_query_is_refused(spark, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "LATEST").write_text(json.dumps({"batch_id": 7, "version": "batch-000000000007"}))
    fit = StreamingFit(stream_estimator(), str(models))
    batch = spark.createDataFrame([([0.0] * 6, 1)], SCHEMA)
    with pytest.raises(
        ConfigError, match="already holds the version of micro-batch 7, but this stream is at"
    ):
        fit(batch, 3)
    with pytest.raises(ConfigError, match="no model version is published under"):
        latest_model(str(tmp_path / "nothing"), model_fn=make_tiny_net)
    with pytest.raises(ConfigError, match="needs a TorchEstimator with model_fn"):
        StreamingFit(stream_estimator(model_fn=None), str(models))


def test_the_streaming_job_trains_the_files_there_then_one_that_lands_after_a_restart(
    spark, tmp_path, monkeypatch, capsys
):
    import shutil

    import jobs.stream_train as cli
    from sparkdl.apps.models import MLPFactory

    monkeypatch.chdir(tmp_path)
    args = ["--config", str(ROOT / "conf/stream.toml"), "--output", "out"]
    args += ["--set", "stream.sample_files=2", "--set", "training.epochs=1"]

    def run_job():
        assert cli.main(args) == 0
        out = capsys.readouterr().out
        return json.loads(out[out.index("{") :])

    first = run_job()  # writes the bundled digits as 2 files, trains one micro-batch each
    assert (first["batches_trained"], first["batches_skipped"], first["latest_batch_id"]) == (2, 0, 1)
    landed = tmp_path / "data/stream/in/digits-0002.parquet"
    shutil.copy(tmp_path / "data/stream/in/digits-0000.parquet", landed)  # newer: read after the others
    second = run_job()  # the same checkpoint: only the new file is trained, from version 1
    assert (second["batches_trained"], second["batches_skipped"], second["latest_batch_id"]) == (1, 0, 2)
    models = str(tmp_path / "out/models")
    assert read_manifest(spark, version_path(models, 2))["initial_model"] == version_path(models, 1)
    assert json.loads((tmp_path / "out/metrics.json").read_text())["latest_version"] == "batch-000000000002"

    model = latest_model(models, model_fn=MLPFactory(64, (64,), 10))
    rows = spark.read.parquet(str(landed))
    correct = model.transform(rows).filter("prediction = label").count()
    assert correct / rows.count() > 0.6  # 3 epochs in all, one per micro-batch: far above chance (0.1)


s3_server = object_store.s3_server  # the fixture: SeaweedFS on loopback


@pytest.mark.slow
def test_versions_publish_to_s3_and_a_restarted_driver_goes_on_from_there(spark, tmp_path, s3_server):
    pytest.importorskip("s3fs")
    conf = {  # the server's credentials as Spark's s3a settings, where a cluster keeps them
        "spark.hadoop.fs.s3a.access.key": s3_server.key,
        "spark.hadoop.fs.s3a.secret.key": s3_server.secret,
        "spark.hadoop.fs.s3a.endpoint": s3_server.endpoint.removeprefix("http://"),
        "spark.hadoop.fs.s3a.connection.ssl.enabled": "false",
    }
    for key, value in conf.items():
        spark.conf.set(key, value)
    try:
        batch_0, batch_1 = (spark.read.parquet(str(f)) for f in write_batch_files(tmp_path / "in", 2))
        models = s3_server.url("stream-models")
        StreamingFit(stream_estimator(), models)(batch_0, 0)
        restarted = StreamingFit(stream_estimator(), models)  # a new driver: finds it all on S3
        restarted(batch_0, 0)  # the replay of batch 0
        restarted(batch_1, 1)
        assert restarted.skipped == [0] and restarted.trained == [1]
        latest = read_latest(spark, models)  # fitted by hand, outside a query: tied to none
        assert latest == {"batch_id": 1, "version": "batch-000000000001", "query_id": ""}
        assert read_manifest(spark, version_path(models, 1))["initial_model"] == version_path(models, 0)
        version_0 = TorchModel.load(version_path(models, 0), model_fn=make_tiny_net)
        by_hand = stream_estimator(initial_model=version_0).fit(batch_1)
        newest = latest_model(models, model_fn=make_tiny_net)
        assert max_abs_diff(newest.module.state_dict(), by_hand.module.state_dict()) < 1e-6
    finally:
        for key in conf:
            spark.conf.unset(key)
