"""Checkpoints on a real S3 server (SeaweedFS on loopback): visible only once their manifest
is written, pruned manifest first, uploaded in the background; and the errors of a scheme
without a filesystem and of credentials the store refuses."""

from __future__ import annotations

import threading

import pytest
import torch

from sparkdl.config import SparkDLConfig
from sparkdl.errors import CheckpointError, ConfigError
from sparkdl.storage.checkpoint_store import CheckpointStore
from sparkdl.storage.filesystems import PathWithOptions, s3a_options
from tests import object_store

pytest.importorskip("s3fs")
s3_server = object_store.s3_server  # the fixture


def _state(step: int) -> dict:
    return {"format": 1, "model": {"w": torch.full((256, 256), float(step))}, "global_steps_done": step}


def test_checkpoints_on_s3_round_trip_in_the_background_and_keep_the_newest_two(s3_server):
    url = s3_server.url("store")
    store = CheckpointStore(url, options=s3_server.options, background=True)
    try:
        for step in (3, 6, 9):
            store.save(step, _state(step))
            store.record_progress(step + 1)
        assert store.load(9)["model"]["w"][0, 0].item() == 9.0  # a load waits for the upload in flight
    finally:
        store.close()
    assert not [t for t in threading.enumerate() if t.name == "sparkdl-checkpoint-upload"]
    names = sorted(p.rsplit("/", 1)[-1] for p in s3_server.fs().ls(url.removeprefix("s3://"), refresh=True))
    assert names == [
        "checkpoint-000000006.json", "checkpoint-000000006.pt",
        "checkpoint-000000009.json", "checkpoint-000000009.pt", "progress",
    ]  # fmt: skip
    reader = CheckpointStore(PathWithOptions(url, s3_server.options))  # options carried by the path
    assert reader.steps() == [6, 9]
    assert reader.progress().step == 10  # written at close
    assert torch.equal(reader.load(6)["model"]["w"], _state(6)["model"]["w"])


def test_a_checkpoint_without_its_manifest_is_never_seen_and_a_truncated_one_is_refused(s3_server):
    """A crash between the file and its manifest leaves a file no reader lists; a file cut
    short under a manifest is refused by its size."""
    url = s3_server.url("crash")
    store = CheckpointStore(url, options=s3_server.options)
    store.save(5, _state(5))
    fs, root = s3_server.fs(), url.removeprefix("s3://")
    import io

    buffer = io.BytesIO()
    torch.save(_state(10), buffer)
    fs.pipe_file(f"{root}/checkpoint-000000010.pt", buffer.getvalue())  # the crash: no manifest after it
    assert store.steps() == [5] and store.latest() == 5
    assert store.load(5)["global_steps_done"] == 5
    fs.pipe_file(f"{root}/checkpoint-000000005.pt", buffer.getvalue()[:1000])  # altered under its manifest
    with pytest.raises(CheckpointError, match=r"checkpoint-000000005.pt: 1000 bytes, its manifest says \d+"):
        store.load(5)


def test_bad_credentials_fail_naming_the_sources_tried_and_never_the_secret(s3_server):
    options = {**s3_server.options, "secret": "not-the-secret-xyz"}
    with pytest.raises(CheckpointError) as caught:
        CheckpointStore(s3_server.url("denied"), options=options)
    message = str(caught.value)
    assert "Credentials were refused or missing" in message
    assert "keys endpoint_url, key, secret" in message and "AWS_ACCESS_KEY_ID" in message
    assert "not-the-secret-xyz" not in message and s3_server.key not in message


def test_a_scheme_without_its_filesystem_installed_names_the_package(tmp_path):
    pytest.importorskip("fsspec")
    with pytest.raises(ConfigError, match=r"gs:// needs the gcsfs package.*pip install gcsfs"):
        SparkDLConfig().replace(checkpoint_dir="gs://bucket/run")
    with pytest.raises(ConfigError, match=r"no filesystem is known for nosuch://"):
        CheckpointStore("nosuch://bucket/run")
    with pytest.raises(ConfigError, match=r"memory-mapped, which s3:// cannot serve"):
        SparkDLConfig().replace(cache_dir="s3://bucket/cache")


def test_spark_s3a_settings_become_s3fs_options():
    conf = {
        "spark.hadoop.fs.s3a.access.key": "AK",
        "spark.hadoop.fs.s3a.secret.key": "SK",
        "spark.hadoop.fs.s3a.endpoint": "minio:9000",
        "spark.hadoop.fs.s3a.connection.ssl.enabled": "false",
    }
    assert s3a_options(conf) == {"key": "AK", "secret": "SK", "endpoint_url": "http://minio:9000"}
    assert s3a_options({"spark.hadoop.fs.s3a.endpoint": "s3.eu-west-1.amazonaws.com"}) == {
        "endpoint_url": "https://s3.eu-west-1.amazonaws.com"
    }
    assert s3a_options({}) == {}


def test_storage_options_stay_out_of_the_settings_repr():
    config = SparkDLConfig().replace(storage_options={"secret": "hush-123"})
    assert "hush-123" not in repr(config)
    assert config.reliability.storage_options == {"secret": "hush-123"}


def test_a_refused_progress_file_is_logged_and_training_goes_on(s3_server, monkeypatch, caplog):
    """The progress file is a hint: a store refusing it (throttling, a blip) is logged; the
    checkpoints, which resume needs, still raise."""
    from sparkdl.storage import checkpoint_store

    monkeypatch.setattr(checkpoint_store, "PROGRESS_EVERY_S", 0.0)
    store = CheckpointStore(s3_server.url("hint"), options=s3_server.options, background=True)
    fs, pipe = store._remote.fs, store._remote.fs.pipe_file

    def refuse_progress(path, *args, **kwargs):
        if path.endswith("/progress"):
            raise OSError("SlowDown: reduce your request rate")
        return pipe(path, *args, **kwargs)

    monkeypatch.setattr(fs, "pipe_file", refuse_progress)
    with caplog.at_level("WARNING", logger="sparkdl.storage.checkpoint_store"):
        for step in (1, 2):
            store.record_progress(step)
            store.save(step, _state(step))  # waits for the progress upload before it: no raise
        store.close()
    assert store.steps() == [1, 2] and store.progress() is None
    assert "write the progress file in" in caplog.text and "SlowDown" in caplog.text


def test_a_failing_worker_gives_its_upload_a_bounded_wait_and_keeps_its_own_error(
    s3_server, monkeypatch, caplog
):
    from sparkdl.storage import checkpoint_store

    monkeypatch.setattr(checkpoint_store, "FAILING_WAIT_S", 0.2)
    store = CheckpointStore(s3_server.url("failing"), options=s3_server.options, background=True)
    release = threading.Event()
    fs = store._remote.fs

    def stuck_open(path, *args, **kwargs):
        release.wait(30)
        raise OSError("connection reset by the store")

    monkeypatch.setattr(fs, "open", stuck_open)
    store.save(4, _state(4))
    uploads = [t for t in threading.enumerate() if t.name == "sparkdl-checkpoint-upload"]
    with caplog.at_level("WARNING", logger="sparkdl.storage.checkpoint_store"):
        store.close(failing=True)  # returns after 0.2 s, not the upload timeout; raises nothing
        assert uploads and uploads[0].is_alive() and "is left running after 0.2 s" in caplog.text
        release.set()
        uploads[0].join(10)
    # not failing, the same failure is the error close raises
    store = CheckpointStore(s3_server.url("failing"), options=s3_server.options, background=True)
    monkeypatch.setattr(store._remote.fs, "open", stuck_open)
    store.save(5, _state(5))
    with pytest.raises(CheckpointError, match="connection reset by the store"):
        store.close()


def test_a_rewritten_step_is_never_listed_while_its_file_is_replaced_and_orphans_are_pruned(
    s3_server, monkeypatch
):
    url = s3_server.url("rewrite")
    store = CheckpointStore(url, options=s3_server.options)
    fs, root = s3_server.fs(), url.removeprefix("s3://")
    fs.pipe_file(f"{root}/checkpoint-000000002.pt", b"a writer died before its manifest")
    for step in (5, 8):
        store.save(step, _state(step))
    store_fs, open_file = store._remote.fs, store._remote.fs.open
    listed_while_written = []

    def watching_open(path, *args, **kwargs):
        if path.endswith("checkpoint-000000008.pt"):
            listed_while_written.append(8 in store.steps())
        return open_file(path, *args, **kwargs)

    monkeypatch.setattr(store_fs, "open", watching_open)
    state = _state(8)
    state["model"]["w"] += 0.5  # the resumed run's step 8: other weights
    store.save(8, state)
    assert listed_while_written == [False] and store.steps() == [5, 8]
    assert store.load(8)["model"]["w"][0, 0].item() == 8.5
    store.save(11, _state(11))
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, refresh=True))
    assert names == [
        "checkpoint-000000008.json",
        "checkpoint-000000008.pt",
        "checkpoint-000000011.json",
        "checkpoint-000000011.pt",
    ]  # fmt: skip  (the orphan of step 2 pruned with step 5)
