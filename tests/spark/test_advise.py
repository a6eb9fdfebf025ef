"""sparkdl.advise on a real local[2] session: one probe stage trains each candidate with
the real loop, strategies and parameter servers, and the advice predicts the run."""

from __future__ import annotations

import threading

import pytest
import torch

import sparkdl
from sparkdl.spark.cluster import executor_hosts
from tests.reference import make_shards
from tests.spark.test_fit import estimator, shards_dataframe

pytestmark = pytest.mark.spark

TINY_NET_PARAMS = 6 * 8 + 8 + 8 * 3 + 3  # TinyNet: Linear(6, 8), Tanh, Linear(8, 3)


def _plain_sgd(params):
    return torch.optim.SGD(params, lr=0.1)  # no momentum: weight averaging moves the weights only


def test_advise_times_every_candidate_on_the_cluster_and_models_the_rest(spark):
    df = shards_dataframe(spark, make_shards([96, 64]))
    est = estimator(optimizer_fn=_plain_sgd, hierarchy="host", epochs=3)
    advice = sparkdl.advise(
        df,
        est,
        steps=4,
        budget_s=0.05,
        strategies=["allreduce", "weight_averaging", "parameter_server sync", "fsdp"],
    )
    model_bytes = 4 * TINY_NET_PARAMS
    measured = {row.name: row for row in advice.rows if row.source == "measured"}
    assert set(measured) == {
        "allreduce",
        "weight_averaging tau=1",
        "weight_averaging tau=4",
        "parameter_server sync",
        "parameter_server sync 1bit",
        "parameter_server sync 1bit, bf16 pulls",
    }
    # what each sent per step, counted by the strategies themselves while the probe trained
    # (local[2] is one host: the hierarchy has nothing to combine, the ring is flat)
    assert measured["allreduce"].bytes_per_step == model_bytes  # a ring of 2 sends the model once
    assert model_bytes <= measured["weight_averaging tau=1"].bytes_per_step < 2 * model_bytes
    ps = measured["parameter_server sync"].bytes_per_step
    # the same frames, the payload 1-bit: 83 signs in 12 bytes plus two float32 means
    ps_1bit = measured["parameter_server sync 1bit"].bytes_per_step
    assert ps > model_bytes and ps - ps_1bit == model_bytes - 20
    # bytes_per_step counts what a worker sent: a bf16 pull asks for less, its request is the same
    assert measured["parameter_server sync 1bit, bf16 pulls"].bytes_per_step == ps_1bit
    # hierarchy refuses fsdp and compressed all-reduce: skipped, with the configuration's reason
    assert "hierarchy = 'host'" in advice.skipped["fsdp"]
    assert "hierarchy = 'host'" in advice.skipped["allreduce 1bit"]
    assert "hierarchy = 'host'" in advice.skipped["allreduce, sufficient factors"]
    assert "hierarchy = 'host'" in advice.skipped["parameter_server sync, sufficient factors"]
    assert "which was not probed" in advice.skipped["weight_averaging tau=8 1bit"]
    # modelled through tau = 1 and 4: c + d / tau, for the run's 160 rows
    tau16 = advice.prediction("weight_averaging tau=16")
    assert tau16.source == "modelled: c + d/k through weight_averaging tau=1 and weight_averaging tau=4"
    assert advice.total_rows == 160
    assert tau16.bytes_per_step == measured["weight_averaging tau=1"].bytes_per_step / 16
    assert advice.recommended.exact and advice.recommended.name in {"allreduce", "parameter_server sync"}
    assert advice.probe.params == TINY_NET_PARAMS and advice.probe.batch_size == 8
    assert advice.probe.link.latency_s > 0 and advice.probe.link.bytes_per_s > 0
    text = str(advice)
    assert "recommended: strategy=" in text and "not probed: " in text
    assert not [t for t in threading.enumerate() if t.name.startswith("sparkdl-ps")]


def test_advise_probes_model_parallelism_where_the_model_allows_it(spark):
    """TinyNet is no nn.Sequential: no pipeline (skipped, with the fix); its two linear
    layers are a pair: tensor parallelism is timed, with the bytes its split layers sent; and
    all-reduce with sufficient factors, exact too."""
    df = shards_dataframe(spark, make_shards([64, 48]))
    advice = sparkdl.advise(
        df,
        estimator(epochs=3),
        steps=4,
        budget_s=0.05,
        strategies=["pipeline", "tensor", "allreduce, sufficient factors"],
    )
    assert "must return an nn.Sequential" in advice.skipped["pipeline"]
    tensor = advice.prediction("tensor")
    assert tensor.source == "measured" and tensor.exact
    # per step: the pair's output (16 rows x 3 classes, float32) all-reduced in a ring of 2, and
    # each worker's 8 rows (6 float32 features, an int64 label) gathered to the other
    assert tensor.bytes_per_step == 16 * 3 * 4 + 8 * (6 * 4 + 8)
    # sufficient factors ("auto") pay for neither of TinyNet's narrow layers at 8 rows a worker:
    # both stay in DDP's buckets, and the ring of 2 sends the model once
    factors = advice.prediction("allreduce, sufficient factors")
    assert factors.source == "measured" and factors.exact
    assert factors.bytes_per_step == 4 * TINY_NET_PARAMS
    # one host (local mode: the driver runs the tasks): no host-level all-reduce row to probe
    assert executor_hosts(spark.sparkContext) == set()
    assert "allreduce hierarchy=host" not in {row.name for row in advice.rows} | set(advice.skipped)


def test_advise_refuses_a_probe_too_short_to_time(spark):
    df = shards_dataframe(spark, make_shards([8, 8]))
    with pytest.raises(sparkdl.ConfigError, match="steps >= 2"):
        sparkdl.advise(df, estimator(), steps=1)


def test_advise_with_lbfgs_predicts_a_pass_with_the_vectors_on_the_workers_or_on_the_shards(spark):
    """optimizer = 'lbfgs' has no strategies of steps to compare: the advice is where its
    vectors live, from a probe of a step-wise stand-in (the local step and the synchronous
    server's), each row a pass over the whole DataFrame."""
    from tests.reference import make_learnable_shards
    from tests.unit.test_lbfgs import softmax_regression

    df = shards_dataframe(spark, make_learnable_shards([60, 37]))
    est = estimator(model_fn=softmax_regression, optimizer_fn=None, optimizer="lbfgs", lr=1.0, history_size=4)
    advice = sparkdl.advise(df, est, steps=4, budget_s=0.05)
    assert {row.name for row in advice.rows} == {"lbfgs allreduce", "lbfgs parameter_server"}
    assert advice.total_rows == 97 and advice.unit == "pass"
    params = advice.probe.params
    ring, served = advice.prediction("lbfgs allreduce"), advice.prediction("lbfgs parameter_server")
    assert ring.bytes_per_step == 4 * params  # a ring of 2 sends the gradient once
    assert served.bytes_per_step > 4 * params  # the push the probe counted: the gradient in its frame
    local = advice.probe.timings["local"].step_s
    # L-BFGS's sums through the run's exchange and its algebra, timed on both workers at once
    assert advice.probe.gradient_sum_s > 0 and advice.probe.vector_op_s > 0
    assert "the gradient's sum as probed" in advice.prediction("lbfgs allreduce").source
    for row in (ring, served):  # the pass reads the larger partition's 8 batches of 8 rows
        assert row.epoch_s > 8 * local and row.samples_per_s == pytest.approx(97 / row.epoch_s)
        assert "4 history pairs" in row.source
    assert advice.recommended.settings["strategy"] in {"allreduce", "parameter_server"}
    assert "pass s" in str(advice) and not [
        t for t in threading.enumerate() if t.name.startswith("sparkdl-ps")
    ]
    with pytest.raises(sparkdl.ConfigError, match="with optimizer = 'lbfgs' the layouts are"):
        sparkdl.advise(df, est, steps=4, strategies=["fsdp"])
