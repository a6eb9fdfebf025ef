"""fit/transform on a real local[2] Spark: reference answers, persistence, Pipeline, errors."""

from __future__ import annotations

import logging
import time

import numpy as np
import pyarrow as pa
import pytest
import torch

import sparkdl
from sparkdl import (
    BadDataError,
    ClusterConfigError,
    ConfigError,
    ModelMismatchError,
    SchemaError,
    TorchEstimator,
    TorchModel,
    TrainingFailedError,
)
from tests.reference import (
    make_deep_net,
    make_shards,
    make_tiny_net,
    max_abs_diff,
    momentum_sgd,
    reference_sgd,
    split_the_first_pair,
)

pytestmark = pytest.mark.spark

LR, MOMENTUM = 0.1, 0.9

_sgd = momentum_sgd  # LR, MOMENTUM: its defaults, in a module the workers import cheaply


def shards_dataframe(spark, shards):
    """One partition per shard, rows in shard order (partition i feeds rank i)."""
    from pyspark.sql import Row

    rows = [
        [Row(features=[float(v) for v in x[i]], label=int(y[i])) for i in range(len(y))] for x, y in shards
    ]
    rdd = spark.sparkContext.parallelize(range(len(shards)), len(shards)).flatMap(lambda i: rows[i])
    return spark.createDataFrame(rdd, "features array<float>, label long")


def estimator(**settings):
    base = dict(
        model_fn=make_tiny_net,
        optimizer_fn=_sgd,
        loss_fn="cross_entropy",
        feature_cols=["features"],
        label_col="label",
        num_workers=2,
        batch_size=8,
        epochs=1,
        seed=0,
        shuffle=False,
        collective_timeout_s=60.0,
    )
    return TorchEstimator(**{**base, **settings})


@pytest.mark.parametrize(("sizes", "epochs", "shuffle"), [([96, 96], 2, False), ([80, 33], 2, True)])
def test_fit_equals_single_process_sgd_on_the_union_of_batches(spark, sizes, epochs, shuffle):
    shards = make_shards(sizes)
    model = estimator(epochs=epochs, shuffle=shuffle).fit(shards_dataframe(spark, shards))
    expected = reference_sgd(shards, 8, epochs, 0, LR, MOMENTUM, shuffle)
    assert max_abs_diff(model.module.state_dict(), expected) < 1e-5
    assert model.worker_rows == sizes
    assert [h["samples"] for h in model.history] == [sum(sizes)] * epochs
    assert [h["worker_samples"] for h in model.history] == [sizes] * epochs
    for record in model.history:
        assert {"epoch", "loss", "samples", "seconds", "samples_per_s"} <= record.keys()
        assert record["loss"] > 0 and record["seconds"] > 0


def test_a_language_model_fits_the_next_token_at_every_position_and_transforms_to_them(spark):
    from sparkdl.apps.models import CausalLMFactory

    vocab, length = 11, 6
    rng = np.random.default_rng(5)
    sequences = [rng.integers(0, vocab, size=(n, length + 1)) for n in (24, 17)]
    shards = [(s[:, :-1], s[:, 1:]) for s in sequences]  # the label: the same ids, one on
    rows = [[(x.tolist(), y.tolist()) for x, y in zip(*shard, strict=True)] for shard in shards]
    rdd = spark.sparkContext.parallelize(range(2), 2).flatMap(lambda i: rows[i])
    df = spark.createDataFrame(rdd, "tokens array<int>, next array<long>")
    lm = CausalLMFactory(vocab, length, dim=8, layers=1, heads=2)

    est = estimator(model_fn=lm, inputs={"tokens": "tokens"}, feature_cols=[], label_col="next", epochs=2)
    model = est.fit(df)

    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, False, model_fn=lm)
    assert max_abs_diff(model.module.state_dict(), expected) < 1e-5
    predicted = model.transform(df).select("tokens", "prediction").collect()
    with torch.no_grad():
        argmax = model.module(torch.tensor([r.tokens for r in predicted])).argmax(-1).double()
    assert [r.prediction for r in predicted] == argmax.tolist()
    from pyspark.sql import functions as F

    top = max(int(s[:, 1:].max()) for s in sequences)
    in_range = df.withColumn(
        "tokens", F.transform("tokens", lambda t: t % (top - 1))
    )  # labels still reach top
    small = CausalLMFactory(top - 1, length, dim=8, layers=1, heads=2)
    with pytest.raises(
        ModelMismatchError, match=f"holds class ids up to {top} .* outputs {top - 1} scores per position"
    ):
        estimator(model_fn=small, inputs={"tokens": "tokens"}, feature_cols=[], label_col="next").fit(
            in_range
        )


@pytest.mark.parametrize("strategy", ["allreduce", "parameter_server"])  # the vectors: workers, shards
def test_lbfgs_fits_pytorchs_iterates_on_the_whole_dataframe_and_reports_each_iteration(spark, strategy):
    from tests.reference import make_learnable_shards
    from tests.unit.test_lbfgs import softmax_regression, torch_lbfgs, union

    shards = make_learnable_shards([60, 37])
    settings = {
        "optimizer": "lbfgs",
        "lr": 1.0,
        "weight_decay": 1e-3,
        "max_iterations": 12,
        "history_size": 4,
        "strategy": strategy,
    }
    model = estimator(model_fn=softmax_regression, optimizer_fn=None, **settings).fit(
        shards_dataframe(spark, shards)
    )
    expected, optimizer = torch_lbfgs(*union(shards), iterations=12)
    assert max_abs_diff(model.module.state_dict(), expected) < 1e-4
    param = next(iter(optimizer.param_groups[0]["params"]))
    assert [h["iteration"] for h in model.history] == list(range(1, 13))
    assert model.history[-1]["passes"] == optimizer.state[param]["func_evals"]
    assert model.history[-1]["stopped"] == "max_iterations"
    predictions = model.transform(shards_dataframe(spark, shards)).select("prediction", "label").toPandas()
    assert (predictions["prediction"] == predictions["label"]).mean() > 0.9  # a linear rule, learned
    with pytest.raises(ConfigError, match="optimizer_fn cannot replace"):
        estimator(optimizer="lbfgs").fit(shards_dataframe(spark, shards))


def test_a_flood_at_the_parameter_servers_port_during_a_fits_start_does_not_fail_it(spark, monkeypatch):
    """Issue 35: 2,000 idle connections from another address, opened as the server starts
    and held until the fit is over, while the workers connect: the fit gives the reference
    answer, and the flood only evicted its own connections."""
    import socket
    import threading

    import sparkdl.spark.driver as driver

    start = driver.start_parameter_server
    floods = []

    def flood(host, port, stop, opened):
        held = []
        try:
            for _ in range(2000):
                if stop.is_set():
                    break
                try:
                    held.append(
                        socket.create_connection((host, port), timeout=5, source_address=("127.0.0.2", 0))
                    )
                except OSError:
                    time.sleep(0.001)
                opened.append(1)
            stop.wait(120)  # held open until the fit is over (bounded)
        finally:
            for sock in held:
                sock.close()

    def flooded(*args, **kwargs):
        hosted = start(*args, **kwargs)
        stop, opened = threading.Event(), []
        thread = threading.Thread(target=flood, args=(hosted.server.host, hosted.server.port, stop, opened))
        thread.start()
        floods.append((hosted, stop, thread))
        deadline = time.monotonic() + 30
        while len(opened) < 500 and time.monotonic() < deadline:  # under way before any worker
            time.sleep(0.01)
        return hosted

    monkeypatch.setattr(driver, "start_parameter_server", flooded)
    shards = make_shards([48, 48])
    try:
        model = estimator(strategy="parameter_server", ps_mode="sync").fit(shards_dataframe(spark, shards))
    finally:
        for _, stop, thread in floods:
            stop.set()
            thread.join(60)
    expected = reference_sgd(shards, 8, 1, 0, LR, MOMENTUM, False)
    assert max_abs_diff(model.module.state_dict(), expected) < 1e-5
    ((hosted, _, _),) = floods
    known = hosted.server._listener._known  # the executors' addresses: a quarter of the places is theirs
    assert "127.0.0.1" in known and "127.0.0.2" not in known
    evicted = sum(
        n for reason, n in hosted.server.refusals.items() if reason.startswith(("evicted", "refused"))
    )
    assert evicted > 300  # the flood was there (its own connections evicted or turned away)


@pytest.mark.parametrize(
    "settings", [{"strategy": "allreduce"}, {"strategy": "weight_averaging", "sync_every": 1}]
)
def test_an_empty_partition_does_not_hang_and_keeps_the_math(spark, settings):
    shards = make_shards([40, 0])
    started = time.monotonic()
    model = estimator(epochs=2, **settings).fit(shards_dataframe(spark, shards))
    assert time.monotonic() - started < 60
    assert model.worker_rows == [40, 0]
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, False)
    assert max_abs_diff(model.module.state_dict(), expected) < 1e-5


class _Planted:
    """What an attacker puts in model_fn.cloudpickle: unpickling it writes a marker file
    (a real attack would run a command), then hands back a working factory."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_plant, (self.marker,))


def _plant(marker):
    from pathlib import Path

    Path(marker).write_text("code from the saved directory ran")
    return make_tiny_net


def test_loading_a_model_or_a_pipeline_runs_no_code_from_the_saved_directory(spark, tmp_path):
    import cloudpickle
    from pyspark.ml import Pipeline, PipelineModel

    df = shards_dataframe(spark, make_shards([24, 24]))
    fitted = Pipeline(stages=[estimator(epochs=1, progress=False)]).fit(df)
    fitted.save(str(tmp_path / "pipeline"))
    stage = next((tmp_path / "pipeline/stages").iterdir())
    marker = tmp_path / "marker"
    (stage / "model_fn.cloudpickle").write_bytes(cloudpickle.dumps(_Planted(str(marker))))
    with pytest.raises(ConfigError, match=r"only as pickled code .* model_fn=\.\.\."):
        TorchModel.load(str(stage))
    with pytest.raises(ConfigError, match=r"sparkdl\.loading"):
        PipelineModel.load(str(tmp_path / "pipeline"))
    assert not marker.exists()
    loaded = TorchModel.load(str(stage), model_fn=make_tiny_net)  # the architecture from the caller
    with sparkdl.loading(model_fn=make_tiny_net):
        pipeline = PipelineModel.load(str(tmp_path / "pipeline"))
    assert not marker.exists()
    expected = fitted.transform(df).select("prediction").collect()
    assert pipeline.transform(df).select("prediction").collect() == expected
    assert loaded.transform(df).select("prediction").collect() == expected
    TorchModel.load(str(stage), trust_pickle=True)  # the explicit opt-in really unpickles
    assert marker.exists()


def test_an_estimator_loads_with_its_functions_from_the_caller_or_on_trust(spark, tmp_path):
    path = str(tmp_path / "estimator")
    estimator(epochs=2).save(path)
    with pytest.raises(ConfigError, match=r"optimizer_fn=\.\.\."):
        TorchEstimator.load(path, model_fn=make_tiny_net)  # it was saved with an optimizer_fn too
    loaded = TorchEstimator.load(path, model_fn=make_tiny_net, optimizer_fn=_sgd)
    assert loaded.model_fn is make_tiny_net and loaded.getOrDefault("epochs") == 2
    trusted = TorchEstimator.load(path, trust_pickle=True)
    assert trusted.model_fn().state_dict().keys() == make_tiny_net().state_dict().keys()


def test_transform_save_load_round_trip_gives_identical_predictions(spark, tmp_path):
    shards = make_shards([60, 60])
    df = shards_dataframe(spark, shards)
    model = estimator(epochs=2).fit(df)
    before = model.transform(df).orderBy("features").collect()
    assert len(before) == 120
    with torch.no_grad():
        x = torch.tensor([r["features"] for r in before])
        direct = model.module(x).argmax(dim=1).double().tolist()
    assert [r["prediction"] for r in before] == direct
    path = str(tmp_path / "model")
    model.save(path)
    with pytest.raises(ConfigError, match=r"only as pickled code \(model_fn.cloudpickle\)"):
        TorchModel.load(path)  # the architecture is code: it comes from the caller
    loaded = TorchModel.load(path, model_fn=model.model_fn)
    assert loaded.history == model.history
    assert loaded.getOrDefault("batch_size") == 8
    after = loaded.transform(df).orderBy("features").collect()
    assert [r["prediction"] for r in after] == [r["prediction"] for r in before]


@pytest.mark.parametrize(
    "settings",
    [
        {"strategy": "pipeline", "microbatches": 4, "pipeline_balance": "time"},
        {"strategy": "tensor", "parallelize_fn": split_the_first_pair},
    ],
)
def test_a_split_model_fits_the_reference_answer_then_transforms_and_saves_as_one(
    spark, tmp_path, settings, caplog, monkeypatch
):
    """Each worker held one stage (pipeline, cut where the layers' measured time is even)
    or half of the first layer pair (tensor, split by the user's ``parallelize_fn``; the
    built-in plan is the unit tests'); the driver's model is the whole one, gathered."""
    from sparkdl.strategies import pipeline_timing

    def no_second_model(model_fn):
        raise AssertionError("the cut by time built a model of its own: it times the preflight's")

    monkeypatch.setattr(pipeline_timing, "build_model", no_second_model)
    shards = make_shards([40, 23])
    df = shards_dataframe(spark, shards)
    est = estimator(model_fn=make_deep_net, epochs=2, shuffle=True, **settings)
    assert est.training_spec(df)[1].parallelize_fn is settings.get("parallelize_fn")  # to the workers
    with caplog.at_level(logging.INFO, logger="sparkdl.strategies.pipeline_timing"):
        model = est.fit(df)
    timed = [r.getMessage() for r in caplog.records if "pipeline cut by measured time" in r.getMessage()]
    assert len(timed) == (settings["strategy"] == "pipeline"), timed
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, True, model_fn=make_deep_net)
    assert max_abs_diff(model.module.state_dict(), expected) < 1e-5
    assert [h["samples"] for h in model.history] == [63, 63]
    predicted = model.transform(df).orderBy("features").collect()
    with torch.no_grad():
        x = torch.tensor([r["features"] for r in predicted])
        direct = model.module(x).argmax(dim=1).double().tolist()
    assert [r["prediction"] for r in predicted] == direct
    model.save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"), model_fn=make_deep_net)
    assert max_abs_diff(loaded.module.state_dict(), expected) < 1e-5


def test_a_pipeline_of_a_model_it_cannot_cut_fails_in_preflight_before_any_task(spark):
    started = time.monotonic()
    with pytest.raises(
        ConfigError,
        match=r"or a Hugging Face decoder with a pipeline plan \(it returned TinyNet\)",
    ):
        estimator(strategy="pipeline").fit(shards_dataframe(spark, make_shards([16, 16])))
    assert time.monotonic() - started < 30
    assert not [s for s in spark.sparkContext.statusTracker().getActiveStageIds()]


def test_regression_outputs_a_double_and_multi_output_an_array(spark):
    from pyspark.sql.types import ArrayType, DoubleType, FloatType

    shards = make_shards([30, 30])
    df = shards_dataframe(spark, shards).selectExpr("features", "cast(label as double) as label")
    model = estimator(model_fn=lambda: torch.nn.Linear(6, 1), loss_fn="mse").fit(df)
    assert model.transform(df).schema["prediction"].dataType == DoubleType()
    raw = estimator(model_fn=lambda: torch.nn.Linear(6, 3), loss_fn=lambda out, y: out.pow(2).mean()).fit(df)
    out = raw.transform(df)
    assert out.schema["prediction"].dataType == ArrayType(FloatType(), False)
    assert len(out.first()["prediction"]) == 3


def test_pipeline_with_vector_assembler_fits_saves_and_loads(spark, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import VectorAssembler

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    label = (x[:, 0] + x[:, 1] > 0).astype(int)
    table = pa.table({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "label": label})
    df = spark.createDataFrame(table.to_pandas())
    pipeline = Pipeline(
        stages=[
            VectorAssembler(inputCols=["a", "b", "c"], outputCol="features"),
            TorchEstimator(
                model_fn=lambda: torch.nn.Sequential(
                    torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
                ),
                optimizer_fn=lambda p: torch.optim.Adam(p, lr=0.05),
                feature_cols=["features"],
                num_workers=2,
                batch_size=16,
                epochs=15,
            ),
        ]
    )
    fitted = pipeline.fit(df)
    predictions = fitted.transform(df).select("label", "prediction").collect()
    accuracy = np.mean([r["label"] == r["prediction"] for r in predictions])
    assert accuracy > 0.9
    path = str(tmp_path / "pipeline")
    fitted.save(path)
    with sparkdl.loading(model_fn=fitted.stages[-1].model_fn):  # PipelineModel.load takes no arguments
        reloaded = PipelineModel.load(path)
    again = reloaded.transform(df).select("prediction").collect()
    assert [r["prediction"] for r in again] == [r["prediction"] for r in predictions]


def test_schema_errors_are_raised_before_any_task_starts(spark):
    df = spark.createDataFrame([("a", 1)], "name string, label long")
    with pytest.raises(SchemaError, match=r"\['features'\] not found"):
        estimator().fit(df)
    with pytest.raises(SchemaError, match=r"column 'name' \(string\) cannot join the float32 matrix"):
        estimator(feature_cols=["name"]).fit(df)


def test_nulls_in_a_feature_fail_with_column_and_count(spark):
    df = spark.createDataFrame(
        [([1.0, 2.0], 0), (None, 1), ([1.0, 2.0], 1), (None, 0)] * 4, "features array<float>, label long"
    ).repartition(2)
    with pytest.raises(BadDataError, match=r"rank \d: column .features. has \d+ null rows") as raised:
        estimator(model_fn=lambda: torch.nn.Linear(2, 2)).fit(df)
    # the error's own fields reach the user, not only its text
    assert raised.value.column == "features" and raised.value.bad_rows > 0
    assert raised.value.rank in (0, 1) and raised.value.agreed_by_all_ranks


def test_more_workers_than_local_slots_fails_at_once_with_the_fix(spark):
    shards = make_shards([10, 10])
    started = time.monotonic()
    with pytest.raises(
        ClusterConfigError,
        match=r"num_workers = 3 but local mode .* only 2 free task slot.*Lower num_workers to 2",
    ):
        estimator(num_workers=3, executor_wait_timeout_s=60.0).fit(shards_dataframe(spark, shards))
    assert time.monotonic() - started < 15  # local mode's slots are fixed: no waiting for more


def test_a_model_with_too_few_outputs_for_a_later_rows_label_fails_before_training(spark):
    shards = make_shards([24, 24])
    x, y = shards[1]
    shards[1] = (x, np.full_like(y, 5))  # rank 1's rows (after the preflight's first 8): class 5
    started = time.monotonic()
    with pytest.raises(ModelMismatchError, match=r"holds class ids up to 5 .* make its last layer output 6"):
        estimator(model_fn=make_tiny_net).fit(shards_dataframe(spark, shards))
    assert time.monotonic() - started < 30  # no worker started: the cold one failed after 30 s


def test_an_empty_dataframe_fails_with_a_clear_error(spark):
    df = spark.createDataFrame([], "features array<float>, label long")
    with pytest.raises(BadDataError, match="has no rows: every partition was empty"):
        estimator().fit(df)


def test_a_label_beyond_the_model_outputs_names_the_count(spark):
    shards = make_shards([16, 16])
    shards[0][1][3] = 5  # the model has 3 outputs
    # the workers' own check, behind the preflight's (which reads the label range first)
    with pytest.raises(BadDataError, match=r"rank 0: 1 labels are >= 3, the number of classes") as raised:
        fit_in_one_attempt(spark, estimator(preflight=False), shards_dataframe(spark, shards))
    assert (raised.value.column, raised.value.bad_rows, raised.value.rank) == ("label", 1, 0)


def fit_in_one_attempt(spark, est, df):
    """``est.fit(df)``, checking that the training stage was not re-run (no failed task)."""
    sc = spark.sparkContext
    group = f"one-attempt-{time.monotonic_ns()}"
    sc.setJobGroup(group, "a fit whose stage must not be re-run")
    try:
        return est.fit(df)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        tracker = sc.statusTracker()
        stages = [s for j in tracker.getJobIdsForGroup(group) for s in tracker.getJobInfo(j).stageIds]
        infos = [info for info in map(tracker.getStageInfo, stages) if info]
        assert infos and all(i.currentAttemptId == 0 and i.numFailedTasks == 0 for i in infos), infos


def test_skipping_bad_rows_trains_exactly_as_on_the_clean_rows(spark):
    from pyspark.sql import Row

    clean = make_shards([40, 40])
    rows = [
        [Row(features=[float(v) for v in x[i]], label=int(y[i])) for i in range(len(y))] for x, y in clean
    ]
    rows[0].insert(7, Row(features=None, label=1))  # a null
    rows[1].insert(3, Row(features=[1.0, float("nan"), 0.0, 0.0, 0.0, 0.0], label=0))  # a NaN
    rows[1].insert(20, Row(features=[1.0, 2.0], label=2))  # too short
    rdd = spark.sparkContext.parallelize(range(2), 2).flatMap(lambda i: rows[i])
    dirty = spark.createDataFrame(rdd, "features array<float>, label long")
    with pytest.raises(BadDataError):
        estimator().fit(dirty)
    model = estimator(on_bad_rows="skip", epochs=2).fit(dirty)
    assert model.bad_rows_skipped == 3
    assert model.worker_rows == [40, 40]
    expected = reference_sgd(clean, 8, 2, 0, LR, MOMENTUM, False)
    assert max_abs_diff(model.module.state_dict(), expected) < 1e-5


def test_a_coalesced_dataframe_trains_as_a_repartitioned_one(spark):
    df = spark.range(64, numPartitions=4).selectExpr(
        "array_repeat(cast(id as float) / 64, 6) as features", "id % 3 as label"
    )
    model = estimator(feature_cols=["features"], epochs=1).fit(df.coalesce(2))  # SPARK-24820 refuses it as is
    assert sum(model.worker_rows) == 64


def test_a_model_fn_the_executors_cannot_import_names_the_missing_module(spark, tmp_path):
    import sys

    (tmp_path / "netdef_only_on_driver.py").write_text(
        "import torch\n\ndef make():\n    return torch.nn.Linear(6, 3)\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import netdef_only_on_driver

        est = estimator(model_fn=netdef_only_on_driver.make, preflight=False, epochs=1)
        with pytest.raises(
            TrainingFailedError, match="ModuleNotFoundError: No module named 'netdef_only_on_driver'"
        ):
            est.fit(shards_dataframe(spark, make_shards([16, 16])))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("netdef_only_on_driver", None)


def logistic_regression() -> torch.nn.Module:
    """Spark ML's binomial LogisticRegression as a model: one logit (coefficients and an intercept)."""
    return torch.nn.Linear(4, 1)


def test_lbfgs_minimizes_spark_mls_logistic_regression_objective(spark):
    """lbfgs.objective = "spark": a weight column's products over the weights' sum, and no L2
    term on the intercept. Spark's LogisticRegression (standardization off, so its L2 term is
    on the coefficients as given) and the estimator reach the same minimum to 1e-4."""
    from pyspark.ml.classification import LogisticRegression
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(3)
    x = rng.normal(size=(240, 4)) * np.array([1.0, 2.0, 0.5, 1.5]) + np.array([0.5, -1.0, 0.0, 2.0])
    logit = x @ np.array([1.2, -0.7, 2.0, 0.3]) - 0.8
    y = (rng.random(240) < 1 / (1 + np.exp(-logit))).astype(float)
    w = rng.uniform(0.2, 3.0, size=240)
    rows = [(Vectors.dense(x[i]), float(y[i]), float(w[i])) for i in range(240)]
    df = spark.createDataFrame(rows, ["features", "label", "w"]).repartition(2)
    reg = 0.05

    def objective(coefficients: np.ndarray, intercept: float) -> float:
        margin = x @ coefficients + intercept
        losses = np.logaddexp(0.0, margin) - y * margin
        return float((w * losses).sum() / w.sum() + reg / 2 * (coefficients**2).sum())

    spark_model = LogisticRegression(
        regParam=reg, elasticNetParam=0.0, standardization=False, weightCol="w", maxIter=500, tol=1e-12
    ).fit(df)
    theirs = objective(spark_model.coefficients.toArray(), spark_model.intercept)
    fitted = estimator(
        model_fn=logistic_regression, optimizer_fn=None, loss_fn="bce_with_logits", weight_col="w",
        optimizer="lbfgs", lr=1.0, weight_decay=reg, objective="spark", max_iterations=200,
        tolerance_grad=1e-9, tolerance_change=1e-12,
    ).fit(df)  # fmt: skip
    state = fitted.module.state_dict()
    ours = objective(state["weight"].double().numpy().reshape(-1), float(state["bias"]))
    assert abs(ours - theirs) < 1e-4, (ours, theirs)
    assert fitted.history[-1]["loss"] == pytest.approx(ours, abs=1e-4)  # it minimized this function
    coefficients = np.concatenate([spark_model.coefficients.toArray(), [spark_model.intercept]])
    assert (
        np.abs(
            np.concatenate([state["weight"].numpy().reshape(-1), state["bias"].numpy()]) - coefficients
        ).max()
        < 1e-2
    )


def test_a_model_fn_that_cannot_be_pickled_fails_before_any_spark_job_naming_it(spark):
    """Issue 54: PySpark's own PicklingError came from inside the first job, after 1.4 s (27 s
    in a fresh session), naming no function."""
    import threading

    lock = threading.Lock()

    def model_with_a_lock():
        with lock:
            return make_tiny_net()

    tracker = spark.sparkContext.statusTracker()
    df = shards_dataframe(spark, make_shards([16, 16]))
    before = set(tracker.getJobIdsForGroup())
    with pytest.raises(
        ConfigError, match=r"cannot send model_fn \(.*model_with_a_lock\) to the workers"
    ) as caught:
        estimator(model_fn=model_with_a_lock).fit(df)
    assert "lock" in str(caught.value)  # the reason: cannot pickle '_thread.lock' object
    assert set(tracker.getJobIdsForGroup()) == before  # no Spark job ran


def test_a_compiled_model_fits_the_reference_answer_reports_its_compile_and_transforms(spark):
    """``compile = true`` (with aot_eager, which traces forward and backward as inductor does
    but compiles in a second, not tens, on 2 CPUs): the workers' compiled models give
    single-process SGD's weights, epoch 1 reports its first step's seconds apart, and
    transform's compiled model predicts as the trained module does."""
    shards = make_shards([48, 40])
    df = shards_dataframe(spark, shards)
    model = estimator(epochs=2, compile=True, compile_backend="aot_eager").fit(df)
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, False)
    assert max_abs_diff(model.module.state_dict(), expected) < 1e-5
    assert model.history[0]["compile_s"] > 0 and "compile_s" not in model.history[1]
    rows = model.transform(df).select("features", "prediction").collect()
    with torch.no_grad():
        logits = model.module(torch.tensor([r.features for r in rows]))
    assert [int(r.prediction) for r in rows] == logits.argmax(dim=1).tolist()
