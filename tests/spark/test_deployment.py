"""Where users run their jobs (issue 56): a fit that starts from a trained model
(``initial_model``, a ``TorchModel`` or a saved one's path: every strategy's model starts
from its weights, and the new model names what it started from), and bad use that fails
clearly (a streaming DataFrame passed to plain fit)."""

from __future__ import annotations

import pytest
import torch

from sparkdl import ConfigError, TorchModel
from tests.reference import make_shards, make_tiny_net, max_abs_diff
from tests.spark.test_fit import estimator, shards_dataframe

pytestmark = pytest.mark.spark


def frozen_sgd(params):
    """lr 0: the weights stay where the fit started, so the result shows the start."""
    return torch.optim.SGD(params, lr=0.0)


@pytest.mark.parametrize("strategy", ["allreduce", "parameter_server"])
def test_a_fit_starts_from_a_trained_models_weights_and_names_it(spark, strategy, tmp_path):
    df = shards_dataframe(spark, make_shards([32, 32]))
    first = estimator(epochs=2).fit(df)
    trained = first.module.state_dict()
    torch.manual_seed(0)  # the seed the workers build model_fn's weights with
    assert max_abs_diff(make_tiny_net().state_dict(), trained) > 1e-3  # the start is not model_fn's

    again = estimator(strategy=strategy, optimizer_fn=frozen_sgd, initial_model=first).fit(df)
    assert max_abs_diff(again.module.state_dict(), trained) == 0.0  # every worker started there
    assert again.initial_model == f"TorchModel {first.uid}"

    first.save(str(tmp_path / "first"))
    from_path = estimator(strategy=strategy, optimizer_fn=frozen_sgd, initial_model=str(tmp_path / "first"))
    third = from_path.fit(df)
    assert max_abs_diff(third.module.state_dict(), trained) == 0.0
    third.save(str(tmp_path / "third"))
    assert TorchModel.load(str(tmp_path / "third"), model_fn=make_tiny_net).initial_model == str(
        tmp_path / "first"
    )


def test_an_initial_model_that_model_fn_does_not_build_is_refused_naming_the_tensors(spark):
    df = shards_dataframe(spark, make_shards([16, 16]))
    first = estimator().fit(df)

    def wider():
        return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))

    with pytest.raises(ConfigError, match=r"initial_model \(TorchModel .*\) does not fit model_fn's model"):
        estimator(model_fn=wider, initial_model=first).fit(df)
    with pytest.raises(ConfigError, match="initial_model must be a fitted TorchModel or the path"):
        estimator(initial_model=42).fit(df)


def test_a_streaming_dataframe_passed_to_fit_is_refused_saying_what_to_do(spark):
    stream = spark.readStream.format("rate").option("rowsPerSecond", 1).load()
    with pytest.raises(ConfigError, match=r"fit got a streaming DataFrame.*foreachBatch.*initial_model"):
        estimator().fit(stream)
