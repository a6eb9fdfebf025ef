"""Strategy "tensor" (DTensor's parallelize_module, Megatron's MLP split) on real gloo
process groups over loopback, without Spark: the plan (pure), the reference answer, 2-D
layouts, checkpoints that move between strategies, validation and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparkdl.config import SparkDLConfig
from sparkdl.errors import ConfigError
from sparkdl.storage.checkpoint_store import CheckpointStore
from sparkdl.strategies import check_settings
from sparkdl.strategies.tensor import check_parallelize_fn, megatron_plan
from sparkdl.worker.assembly import TrainSpec
from tests.reference import (
    make_deep_net,
    make_shards,
    max_abs_diff,
    reference_sgd,
    shard_plan,
    shard_to_batch,
    split_the_first_pair,
)
from tests.unit.test_fsdp import spawn
from tests.unit.test_pipeline import train as train_split
from tests.unit.test_worker_gloo import LR, MOMENTUM, _sgd, run_workers


class Block(nn.Module):
    """A residual MLP block, its MLP an nn.Sequential (the plan pairs only inside one: its
    order is the data's path)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.0), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def make_block_net() -> nn.Module:
    """Two residual MLP blocks between an input and an output layer (not a Sequential of
    pairs: the plan finds the pairs inside the blocks)."""
    return nn.Sequential(nn.Linear(6, 8), Block(), Block(), nn.Linear(8, 3))


class Buckets(nn.Module):
    """Each feature as an id: which of 12 buckets of width 0.5 it falls in (none trained)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x + 3.0) * 2.0).floor().long().clamp(0, 11)


def make_embedding_net() -> nn.Module:
    """Ids looked up in an embedding of 12 rows (split by rows: a slice of the vocabulary on
    each worker), then a pair of linear layers."""
    return nn.Sequential(
        Buckets(), nn.Embedding(12, 4), nn.Flatten(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 3)
    )


def test_the_plan_pairs_a_linear_with_the_next_that_takes_its_output():
    assert megatron_plan(make_deep_net(), 2) == {"0": "columns", "2": "rows", "4": "columns", "6": "rows"}
    # the blocks' own pairs; the outer layers have no Linear right after them
    assert megatron_plan(make_block_net(), 4) == {
        "1.mlp.0": "columns", "1.mlp.3": "rows", "2.mlp.0": "columns", "2.mlp.3": "rows",
    }  # fmt: skip
    # a softmax or a norm over the features would see one worker's slice: no pair across them
    across = nn.Sequential(nn.Linear(6, 8), nn.Softmax(dim=-1), nn.Linear(8, 3))
    assert megatron_plan(across, 2) == {}
    # registration order is no data path outside a Sequential: q and k of one width are no pair
    attention = nn.Module()
    attention.q, attention.k = nn.Linear(8, 8), nn.Linear(8, 8)
    assert megatron_plan(attention, 2) == {}
    odd = nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 3))
    assert megatron_plan(odd, 2) == {}  # 9 hidden features do not split in 2


@pytest.mark.parametrize(
    ("settings", "fix"),
    [
        ({"num_workers": 1}, "at least 2 workers"),
        ({"num_workers": 3, "tp_size": 2}, "set num_workers to 2 or tp_size"),
        ({"num_workers": 2, "precision": "fp16"}, "use precision = 'bf16'"),
        ({"num_workers": 2, "compression": "fp16"}, "set compression = 'none'"),
    ],
)
def test_settings_tensor_parallelism_cannot_run_are_refused_with_the_fix(settings, fix):
    with pytest.raises(ConfigError, match=fix):
        check_settings(SparkDLConfig().replace(strategy="tensor", **settings))


def train(shards, tmp_path, optimizer_fn=_sgd, model_fn=make_deep_net, parts=None, **settings):
    return train_split(
        shards, tmp_path, optimizer_fn, parts, strategy="tensor", model_fn=model_fn, **settings
    )


def split_nothing(module: nn.Module, mesh) -> None:
    """A user's split that forgot to shard anything."""


@pytest.mark.slow
def test_your_own_parallelize_fn_splits_what_it_shards_and_gives_single_process_sgds_weights(tmp_path):
    shards = make_shards([32, 32])
    state, results = train(
        shards, tmp_path, batch_size=8, epochs=2, shuffle=False, parallelize_fn=split_the_first_pair
    )
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, False, model_fn=make_deep_net)
    assert max_abs_diff(state, expected) < 1e-5
    # the counters follow the user's split: a step sums the first pair's output over the group's
    # 16 rows (8 float32 each; the first layer's input has no gradient) and gathers each worker's
    # 8 rows (6 float32 features, an int64 label); the built-in plan would also sum the second's
    assert [h["bytes_sent"] for h in results[0][0]][1] == 4 * (16 * 8 * 4 + 8 * (6 * 4 + 8))
    _, failed = train_split(
        shards, tmp_path / "none", _sgd, None, strategy="tensor", parallelize_fn=split_nothing, check=False
    )
    assert "parallelize_fn split no layer over the tensor-parallel group of 2 workers" in str(failed[0][1])


def test_a_parallelize_fn_the_settings_would_not_use_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="set strategy = 'tensor', or drop parallelize_fn"):
        check_parallelize_fn(SparkDLConfig().replace(strategy="allreduce"))
    with pytest.raises(ConfigError, match="drop tensor_plan"):
        check_parallelize_fn(SparkDLConfig().replace(strategy="tensor", tensor_plan=["0:columns", "2:rows"]))
    check_parallelize_fn(SparkDLConfig().replace(strategy="tensor"))
    from sparkdl import TorchEstimator  # the estimator refuses it before reading any row

    unused = TorchEstimator(model_fn=make_deep_net, parallelize_fn=split_the_first_pair, strategy="fsdp")
    with pytest.raises(ConfigError, match="but strategy = 'fsdp'"):
        unused.training_spec(None)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sizes", "settings"),
    [
        ([50, 21], {"shuffle": False}),  # uneven
        ([30, 0, 17, 9], {"shuffle": True}),  # 4 workers split every pair, one without rows
        ([30, 22, 17, 9], {"tp_size": 2, "shuffle": True}),  # 2 groups of 2: replicas
        ([30, 22, 0, 0], {"tp_size": 2, "shuffle": True}),  # a whole group without rows
    ],
)
def test_split_layers_give_single_process_sgds_weights(tmp_path, sizes, settings):
    shards = make_shards(sizes)
    state, results = train(shards, tmp_path, batch_size=8, epochs=2, **settings)
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, settings["shuffle"], model_fn=make_deep_net)
    assert max_abs_diff(state, expected) < 1e-5
    history = results[0][0]
    assert [h["samples"] for h in history] == [sum(sizes)] * 2
    assert all(h["bytes_sent"] > 0 for h in history)  # the split layers' partial sums


class AttributeNet(nn.Module):
    """An MLP whose layers are attributes, called in forward: no nn.Sequential, so the
    built-in plan sees no data path and splits nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(6, 16), nn.Linear(16, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


def test_your_own_plan_is_checked_against_the_layers_it_names():
    from sparkdl.strategies.tensor import TensorParallelStrategy

    assert megatron_plan(AttributeNet(), 2) == {}
    config = SparkDLConfig().replace(strategy="tensor", num_workers=2)
    with pytest.raises(ConfigError, match=r"nothing to split"):
        TensorParallelStrategy.check_model(AttributeNet(), config)
    planned = config.replace(tensor_plan=("fc1:columns", "fc2:rows"))
    TensorParallelStrategy.check_model(AttributeNet(), planned)
    for plan, refusal in [
        (("fc1",), r"'fc1' is not 'layer.name:columns'"),
        (("fc3:columns",), r"names 'fc3', which is no module of the model; its modules are fc1, fc2, head"),
        (("fc1:vocabulary",), r"splits 'fc1' by vocabulary, which needs an nn.Embedding; it is Linear"),
        (("head:columns",), r"splits 'head' by columns over 2 workers, but its 3 do not divide by 2"),
    ]:
        with pytest.raises(ConfigError, match=refusal):
            TensorParallelStrategy.check_model(AttributeNet(), config.replace(tensor_plan=plan))


@pytest.mark.slow
def test_your_own_plan_splits_a_model_outside_a_sequential_to_single_process_sgds_weights(tmp_path):
    shards = make_shards([40, 23])
    plan = ("fc1:columns", "fc2:rows")
    state, results = train(
        shards, tmp_path, model_fn=AttributeNet, batch_size=8, epochs=2, shuffle=True, tensor_plan=plan
    )
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, True, model_fn=AttributeNet)
    assert max_abs_diff(state, expected) < 1e-5
    assert all(h["bytes_sent"] > 0 for h in results[0][0])  # the pair's partial sums


def test_an_embedding_is_split_by_its_vocabulary_where_it_divides():
    split = {"1": "vocabulary", "3": "columns", "5": "rows"}
    assert megatron_plan(make_embedding_net(), 2) == split
    assert megatron_plan(make_embedding_net(), 4) == split
    assert megatron_plan(make_embedding_net(), 5) == {}  # 12 ids and 16 features: neither divides
    assert megatron_plan(nn.Sequential(nn.Embedding(12, 4, max_norm=1.0)), 2) == {}
    assert megatron_plan(nn.Sequential(nn.Embedding(12, 4, sparse=True)), 2) == {}


@pytest.mark.slow
def test_a_split_embedding_gives_single_process_sgds_weights(tmp_path):
    """Each of 2 workers looks up the ids of its half of the vocabulary (the other half's rows
    come back zero) and the all-reduce sums them: the same lookups, the same gradients."""
    shards = make_shards([40, 23])
    state, _ = train(shards, tmp_path, model_fn=make_embedding_net, batch_size=8, epochs=2, shuffle=True)
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, True, model_fn=make_embedding_net)
    assert max_abs_diff(state, expected) < 1e-5
    assert state["1.weight"].shape == (12, 4)  # gathered whole


@pytest.mark.slow
def test_residual_blocks_split_inside_give_single_process_sgds_weights(tmp_path):
    shards = make_shards([40, 23])
    state, _ = train(shards, tmp_path, model_fn=make_block_net, batch_size=8, epochs=2, shuffle=True)
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, True, model_fn=make_block_net)
    assert max_abs_diff(state, expected) < 1e-5


@pytest.mark.slow
def test_clipping_split_and_whole_layers_and_accumulating_equal_all_reduce(tmp_path):
    """The block net holds split layers (DTensors) and whole ones (its outer layers): the
    norm spans both; two micro-batches of 4 each run on their own."""
    shards = make_shards([45, 30])
    settings = {"batch_size": 4, "accumulate_steps": 2, "epochs": 2, "grad_clip_norm": 0.05, "shuffle": True}
    state, _ = train(shards, tmp_path / "tensor", _adam, model_fn=make_block_net, **settings)
    expected, _ = run_workers(shards, tmp_path / "allreduce", _adam, model_fn=make_block_net, **settings)
    assert max_abs_diff(state, expected) < 1e-5


def _adam(params):
    return torch.optim.Adam(params, lr=0.01)


@pytest.mark.slow
def test_tensor_parallel_with_adam_and_clipping_equals_all_reduce_and_resumes_under_it(tmp_path):
    """The same weights and losses as all-reduce; the checkpoint it writes (gathered whole)
    resumes under all-reduce to the same weights as an uninterrupted run."""
    shards = make_shards([45, 30])
    settings = {"batch_size": 8, "epochs": 2, "grad_clip_norm": 0.05, "shuffle": True}
    state, results = train(shards, tmp_path / "tensor", _adam, **settings)
    expected, reference = run_workers(
        shards, tmp_path / "allreduce", _adam, model_fn=make_deep_net, **settings
    )
    assert max_abs_diff(state, expected) < 1e-5
    assert [h["loss"] for h in results[0][0]] == pytest.approx([h["loss"] for h in reference[0][1]], rel=1e-6)
    marker = tmp_path / "drill"
    config = SparkDLConfig().replace(
        num_workers=2, collective_timeout_s=10.0, strategy="tensor", checkpoint_every=2,
        checkpoint_dir=str(tmp_path / "ckpt"), fault_injection=f"raise:1:11:{marker}", **settings,
    )  # fmt: skip
    plan, template = shard_plan(shards)
    parts = [[shard_to_batch(x, y)] for x, y in shards]
    failed = spawn(parts, TrainSpec(config, make_deep_net, _adam, "cross_entropy", plan, template), tmp_path)
    assert "fault drill: rank 1 raised at step 11" in str(failed[1][1])
    assert CheckpointStore(str(tmp_path / "ckpt")).latest() == 10
    resumed, _ = run_workers(
        shards,
        tmp_path / "resumed",
        _adam,
        model_fn=make_deep_net,
        checkpoint_dir=str(tmp_path / "ckpt"),
        **settings,
    )
    assert max_abs_diff(resumed, expected) < 1e-5


@pytest.mark.slow
def test_validation_gathers_the_groups_rows_and_matches_all_reduce(tmp_path):
    from sparkdl.data.columns import LabelKind
    from sparkdl.data.decoding import decode_block
    from sparkdl.data.inputs import plan_data
    from sparkdl.data.tensors import to_batch
    from tests.unit.test_fsdp import _with_held_out

    shards = make_shards([40, 24])
    parts = [[_with_held_out(*shards[0], held=20)], [_with_held_out(*shards[1], held=3)]]
    plan = plan_data(
        parts[0][0].schema, feature_cols=("features",), label_col="label",
        label_kind=LabelKind.CLASS_INDEX, validation_col="val",
    )  # fmt: skip
    template = to_batch(decode_block(parts[0][0].slice(0, 2), plan), plan)
    figures = {}
    for strategy in ("tensor", "allreduce"):
        config = SparkDLConfig().replace(
            num_workers=2, collective_timeout_s=30.0, strategy=strategy, batch_size=8, epochs=2,
            inference_batch_size=4, optimizer="adam", lr=0.05,
        )  # fmt: skip
        results = spawn(
            parts,
            TrainSpec(config, make_deep_net, None, "cross_entropy", plan, template),
            tmp_path / strategy,
        )
        assert all(e is None for _, e, _ in results.values()), results
        figures[strategy] = [(h["val_loss"], h["val_samples"]) for h in results[0][0]]
    assert [f[1] for f in figures["tensor"]] == [23, 23]
    assert [f[0] for f in figures["tensor"]] == pytest.approx([f[0] for f in figures["allreduce"]], rel=1e-5)


def test_a_model_with_no_pair_to_split_is_refused_on_the_driver():
    from sparkdl.strategies.tensor import TensorParallelStrategy

    config = SparkDLConfig().replace(strategy="tensor", num_workers=2)
    with pytest.raises(ConfigError, match=r"nothing to split in the model: no pair of linear .*tp_size = 2"):
        TensorParallelStrategy.check_model(nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 3)), config)
    TensorParallelStrategy.check_model(make_deep_net(), config)
