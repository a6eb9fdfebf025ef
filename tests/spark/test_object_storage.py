"""A fit whose checkpoints are on a real S3 server (SeaweedFS on loopback, issue 56 item 1):
a worker fails, the stage resumes from the checkpoints there to the weights of a run without
the fault, and the model saves and loads there, the JVM having no s3a connector."""

from __future__ import annotations

import pytest
import torch

from sparkdl import TorchModel
from tests import object_store
from tests.reference import make_shards, make_tiny_net, max_abs_diff
from tests.spark.test_fit import estimator, shards_dataframe
from tests.spark.test_reliability import EVERY

pytestmark = [pytest.mark.spark, pytest.mark.slow]
pytest.importorskip("s3fs")
s3_server = object_store.s3_server  # the fixture

_S3A = ("access.key", "secret.key", "endpoint", "connection.ssl.enabled")


@pytest.fixture
def s3a_conf(spark, s3_server):
    """The server's credentials as Spark's s3a settings, where a cluster keeps them."""
    values = (s3_server.key, s3_server.secret, s3_server.endpoint.removeprefix("http://"), "false")
    for key, value in zip(_S3A, values, strict=True):
        spark.conf.set(f"spark.hadoop.fs.s3a.{key}", value)
    yield
    for key in _S3A:
        spark.conf.unset(f"spark.hadoop.fs.s3a.{key}")


def test_a_fit_resumes_from_s3_checkpoints_to_identical_weights_and_its_model_saves_and_loads_there(
    spark, tmp_path, s3_server, s3a_conf
):
    df = shards_dataframe(spark, make_shards([96, 96]))
    settings = {"epochs": 1, "shuffle": True, "checkpoint_every": EVERY, "collective_timeout_s": 20.0}
    clean = estimator(checkpoint_dir=str(tmp_path / "clean"), **settings).fit(df)
    url = s3_server.url("fit")
    marker = tmp_path / "fired"
    model = estimator(checkpoint_dir=url, fault_injection=f"raise:1:10:{marker}", **settings).fit(df)
    assert marker.exists()  # the drill did fire
    assert max_abs_diff(model.module.state_dict(), clean.module.state_dict()) == 0.0
    resumed = [h for h in model.history if "resumed_from_step" in h]
    assert [r["resumed_from_step"] for r in resumed] == [10 - 10 % EVERY]
    fs, root = s3_server.fs(), url.removeprefix("s3://")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, refresh=True))
    manifests = [n for n in names if n.endswith(".json")]
    assert len(manifests) == 2 and all(n.removesuffix(".json") + ".pt" in names for n in manifests)

    model.set(model.getParam("storage_options"), s3_server.options)  # credentials a user set
    model.write().overwrite().save(f"{url}/model")
    saved = b"".join(fs.cat_file(p) for p in fs.find(f"{root}/model/metadata"))
    assert b'"class":"sparkdl.ml.estimator.TorchModel"' in saved
    assert s3_server.secret.encode() not in saved and b"storage_options" not in saved
    loaded = TorchModel.load(f"{url}/model", model_fn=make_tiny_net)
    assert max_abs_diff(loaded.module.state_dict(), model.module.state_dict()) == 0.0
    assert loaded.transform(df.limit(16)).count() == 16


def make_small_net():
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_a_pipeline_saves_and_loads_on_s3_where_the_jvm_has_no_connector(spark, s3_server, s3a_conf):
    """pyspark's own writer needs the JVM's s3 connector for the pipeline's metadata and its
    JVM stages; save_pipeline writes the same folder through fsspec (the JVM stages saved to
    local disk and uploaded), and load_pipeline reads it back: the same predictions."""
    import numpy as np
    import pyarrow as pa
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import StandardScaler, VectorAssembler

    from sparkdl import TorchEstimator, load_pipeline, loading, save_pipeline

    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 3)) * [1.0, 10.0, 0.1]
    table = pa.table({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "label": (x[:, 0] > 0).astype(int)})
    df = spark.createDataFrame(table.to_pandas())
    pipeline = Pipeline(
        stages=[
            VectorAssembler(inputCols=["a", "b", "c"], outputCol="raw"),
            StandardScaler(inputCol="raw", outputCol="features"),
            TorchEstimator(
                model_fn=make_small_net, feature_cols=["features"], num_workers=2, batch_size=16, epochs=3,
                progress=False,
            ),
        ]
    )  # fmt: skip
    fitted = pipeline.fit(df)
    url = s3_server.url("pipelines")
    with pytest.raises(Exception, match=r"(?i)scheme"):  # the premise: no connector in this JVM
        fitted.write().save(f"{url}/by-pyspark")
    save_pipeline(fitted, f"{url}/model")
    save_pipeline(pipeline, f"{url}/unfitted")
    fs, root = s3_server.fs(), url.removeprefix("s3://")
    folders = fs.ls(f"{root}/model/stages", refresh=True)
    stages = sorted(p.rsplit("/", 1)[-1].split("_", 1)[1] for p in folders)
    assert stages == sorted(stage.uid for stage in fitted.stages)  # pyspark's layout: stages/<i>_<uid>
    with pytest.raises(FileExistsError, match=r"already holds a saved pipeline.*overwrite=True"):
        save_pipeline(fitted, f"{url}/model")
    save_pipeline(fitted, f"{url}/model", overwrite=True)
    assert fs.find(f"{root}/model/stages/0_{fitted.stages[0].uid}/metadata")  # its files, not a copy below

    with loading(model_fn=make_small_net):
        loaded = load_pipeline(f"{url}/model")
        unfitted = load_pipeline(f"{url}/unfitted")
    assert isinstance(loaded, PipelineModel) and loaded.uid == fitted.uid
    expected = fitted.transform(df).select("prediction").collect()
    assert loaded.transform(df).select("prediction").collect() == expected
    assert isinstance(unfitted, Pipeline) and [s.uid for s in unfitted.getStages()] == [
        s.uid for s in pipeline.getStages()
    ]
    assert unfitted.getStages()[-1].getOrDefault("epochs") == 3
