"""Strategy "pipeline" (torch.distributed.pipelining) on real gloo process groups over
loopback, without Spark: the reference answer, 2-D layouts, checkpoints that move between
strategies, resume after a lost worker, validation and the refusals. The cut itself
(:func:`balance`, :func:`stage_starts`) is pure and tested first.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import time

import pytest
import torch
from torch import nn

from sparkdl.advisor.costmodel import full_shard_bytes, pipeline_bytes, tensor_bytes
from sparkdl.advisor.shape import model_shape
from sparkdl.config import SparkDLConfig
from sparkdl.data.tensors import Batch
from sparkdl.errors import ConfigError
from sparkdl.storage.checkpoint_store import CheckpointStore
from sparkdl.strategies import check_settings
from sparkdl.strategies.pipeline_layout import Layout, balance, stage_starts
from sparkdl.worker.assembly import TrainSpec
from tests.reference import (
    make_deep_net,
    make_shards,
    max_abs_diff,
    reference_sgd,
    shard_plan,
    shard_to_batch,
)
from tests.unit.test_fsdp import last_checkpoint, spawn
from tests.unit.test_worker_gloo import LR, MOMENTUM, _sgd, run_workers

# ------------------------------------------------------------------ the cut (pure)


def test_balance_minimises_the_largest_stage():
    assert balance([1, 1, 1, 1], 2) == [0, 2]
    assert balance([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [0, 1]  # the big layer alone
    assert balance([1, 1, 1, 1, 1, 1, 1, 1, 8], 3) == [0, 4, 8]
    assert balance([5, 0, 5, 0, 5], 3) == [0, 2, 4]  # parameterless layers ride along
    rng = random.Random(5)
    for _ in range(30):  # against every possible cut
        costs = [rng.randint(0, 9) for _ in range(rng.randint(3, 8))]
        parts = rng.randint(1, len(costs))
        every = [[0, *cuts] for cuts in itertools.combinations(range(1, len(costs)), parts - 1)]
        assert _worst(costs, balance(costs, parts)) == min(_worst(costs, s) for s in every)
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3"):
        balance([1, 1], 3)


def _worst(costs, starts):
    return max(sum(costs[a:b]) for a, b in itertools.pairwise([*starts, len(costs)]))


def test_stage_starts_by_name_and_what_it_refuses():
    names, costs = ["embed", "block1", "block2", "head"], [4, 2, 2, 1]
    assert stage_starts(names, costs, 2, ()) == [0, 1]
    assert stage_starts(names, costs, 2, ("block2",)) == [0, 2]
    with pytest.raises(ConfigError, match=r"names \['blok2'\], not top-level layers.*embed, block1"):
        stage_starts(names, costs, 2, ("blok2",))
    with pytest.raises(ConfigError, match="in the model's order"):
        stage_starts(names, costs, 3, ("head", "block1"))
    with pytest.raises(ConfigError, match="3 stages need 2"):
        stage_starts(names, costs, 3, ("block1",))
    with pytest.raises(ConfigError, match=r"4 top-level layers.*cannot be cut into 5 stages"):
        stage_starts(names, costs, 5, ())


class Sleepy(nn.Module):
    """A layer of few parameters that takes long: its forward sleeps ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.linear, self.seconds = nn.Linear(6, 6), seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


def sleepy_net() -> nn.Sequential:
    """Four layers of 42 parameters each and their activations; the first takes 30 ms a
    pass, the others microseconds: by parameters the cut of 2 stages falls in the middle,
    by time right after the slow layer."""
    linear = functools.partial(nn.Linear, 6, 6)
    return nn.Sequential(Sleepy(0.03), nn.Tanh(), linear(), nn.Tanh(), linear(), linear())


def test_a_cut_by_time_gives_a_slow_layer_a_stage_of_its_own_where_parameters_would_not():
    from sparkdl.data.tensors import Batch
    from sparkdl.strategies.pipeline_timing import cut_by_time, layer_seconds, timed_split

    whole = sleepy_net()
    seconds = layer_seconds(list(whole), torch.randn(8, 6), repeats=2)
    # the sleep bounds the slow layer from below; the others are microseconds, but a loaded
    # machine can stretch them to milliseconds: compare with the sleep, not with a ratio
    assert seconds[0] >= 0.03 > sum(seconds[1:]), seconds
    names = [name for name, _ in whole.named_children()]
    costs = [sum(p.numel() for p in layer.parameters()) for layer in whole]
    assert [names[i] for i in balance(costs, 2)] == ["0", "4"]  # 84 parameters on either side
    split, per_stage = timed_split(whole, torch.randn(8, 6), 2)
    assert split == ("2",)  # the slow layer and its activation alone; the activation stays with it
    assert per_stage[0] >= 0.03 > per_stage[1], per_stage
    with pytest.raises(ConfigError, match=r"3 top-level layers with trainable parameters; .* into 4"):
        timed_split(sleepy_net()[:5], torch.randn(8, 6), 4)

    timed = SparkDLConfig().replace(
        strategy="pipeline", num_workers=2, pipeline_balance="time", microbatches=4
    )
    rows = Batch({"features": torch.randn(3, 6)}, torch.zeros(3))
    assert cut_by_time(timed, sleepy_net, rows).pipeline.split_before == ("2",)
    named = timed.replace(split_before=("4",))
    assert cut_by_time(named, sleepy_net, rows) is named  # the user's cut stands
    assert cut_by_time(SparkDLConfig(), sleepy_net, rows).pipeline.split_before == ()
    with pytest.raises(ConfigError, match=r"pipeline_balance = 'time' times the layers on the DataFrame's"):
        cut_by_time(timed, sleepy_net, None)
    two_inputs = Batch({"a": torch.randn(3, 6), "b": torch.randn(3, 6)}, torch.zeros(3))
    with pytest.raises(ConfigError, match=r"feeds the first layer one tensor, but the rows have 2 inputs"):
        cut_by_time(timed, sleepy_net, two_inputs)


def test_layout_puts_a_pipeline_on_consecutive_ranks():
    layout = Layout.of(SparkDLConfig().replace(strategy="pipeline", stages=2), 6)
    assert (layout.stages, layout.replicas) == (2, 3)
    assert layout.pipeline_ranks(1) == [2, 3]
    assert layout.replica_ranks(1) == [1, 3, 5]
    assert (layout.stage_of(5), layout.replica_of(5)) == (1, 2)
    assert Layout.of(SparkDLConfig().replace(strategy="pipeline"), 4) == Layout(4, 1)


@pytest.mark.parametrize(
    ("settings", "fix"),
    [
        ({"num_workers": 1}, "needs at least 2 stages"),
        ({"num_workers": 3, "stages": 2}, "set num_workers to 2 or pipeline.stages"),
        ({"num_workers": 4, "microbatches": 2}, "raise microbatches"),
        ({"num_workers": 2, "split_before": ("a", "b")}, "2 stages need 1"),
        ({"num_workers": 2, "precision": "fp16"}, "use precision = 'bf16'"),
        ({"num_workers": 2, "compression": "1bit"}, "set compression = 'none'"),
    ],
)
def test_settings_a_pipeline_cannot_run_are_refused_with_the_fix(settings, fix):
    with pytest.raises(ConfigError, match=fix):
        check_settings(SparkDLConfig().replace(strategy="pipeline", **settings))


# ------------------------------------------------------------------ training


def _adam(params):
    return torch.optim.Adam(params, lr=0.01)


def train(
    shards,
    tmp_path,
    optimizer_fn=_sgd,
    parts=None,
    strategy="pipeline",
    model_fn=make_deep_net,
    parallelize_fn=None,
    check=True,
    **settings,
):
    """Train with ``strategy`` (a model-parallel one); return rank 0's final weights and the
    results (with ``check``, after asserting that no rank failed)."""
    config = SparkDLConfig().replace(
        num_workers=len(shards),
        collective_timeout_s=30.0,
        prefetch_batches=2,
        strategy=strategy,
        **{"checkpoint_dir": str(tmp_path / "ckpt"), **settings},
    )
    plan, template = shard_plan(shards)
    spec = TrainSpec(
        config, model_fn, optimizer_fn, "cross_entropy", plan, template, parallelize_fn=parallelize_fn
    )
    if parts is None:
        parts = [[shard_to_batch(x, y)] if len(y) else [] for x, y in shards]
    state: dict = {}
    results = spawn(parts, spec, tmp_path, weights=state)
    errors = {r: e for r, (_, e, _) in results.items() if e is not None}
    assert not errors or not check, errors
    return state, results


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sizes", "settings"),
    [
        # 2 stages; 3 micro-batches do not divide the step's 16 rows; uneven partitions
        ([50, 21], {"microbatches": 3, "pipeline_schedule": "gpipe", "shuffle": False}),
        ([50, 21], {"microbatches": 5, "pipeline_schedule": "1f1b", "shuffle": True}),
        # 4 stages, one worker without rows
        ([30, 0, 17, 9], {"microbatches": 4, "pipeline_schedule": "1f1b", "shuffle": True}),
        # 2 stages x 2 replicas (DistBelief's layout), the replicas' gradients all-reduced
        ([30, 22, 17, 9], {"stages": 2, "microbatches": 2, "pipeline_schedule": "1f1b", "shuffle": True}),
        # a whole pipeline without rows: it steps on padding alone and joins the replicas' sum
        ([30, 22, 0, 0], {"stages": 2, "microbatches": 2, "pipeline_schedule": "gpipe", "shuffle": True}),
    ],
)
def test_a_pipeline_gives_single_process_sgds_weights(tmp_path, sizes, settings):
    shards = make_shards(sizes)
    state, results = train(shards, tmp_path, batch_size=8, epochs=2, **settings)
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, settings["shuffle"], model_fn=make_deep_net)
    assert max_abs_diff(state, expected) < 1e-5
    history = results[0][0]
    assert [h["samples"] for h in history] == [sum(sizes)] * 2
    assert all(h["steps"] == max((s + 7) // 8 for s in sizes) for h in history)
    assert all(h["bytes_sent"] > 0 for h in history)  # activations crossed between the stages
    saved = last_checkpoint(tmp_path / "ckpt")
    assert max_abs_diff(saved["model"], state) == 0  # the whole model, gathered


def recording_deep_net(path: str) -> nn.Sequential:
    """make_deep_net, noting which process built it on which device."""
    with open(path, "a") as built:
        built.write(f"{os.getpid()} {torch.empty(0).device.type}\n")
    return make_deep_net()


@pytest.mark.slow
def test_only_rank_0_builds_the_whole_model_and_every_other_rank_receives_its_stage(tmp_path):
    """2 stages x 2 replicas: ranks 1-3 build the model on the meta device only (no memory)
    and allocate their stage, which rank 0 sends them; the weights are single-process SGD's."""
    shards = make_shards([30, 22, 17, 9])
    built = tmp_path / "built"
    model_fn = functools.partial(recording_deep_net, str(built))
    settings = {"stages": 2, "microbatches": 2, "pipeline_schedule": "1f1b", "shuffle": False}
    state, _ = train(shards, tmp_path, model_fn=model_fn, batch_size=8, epochs=1, **settings)
    expected = reference_sgd(shards, 8, 1, 0, LR, MOMENTUM, False, model_fn=make_deep_net)
    assert max_abs_diff(state, expected) < 1e-5
    devices: dict[str, list[str]] = {}
    for line in built.read_text().splitlines():
        pid, device = line.split()
        devices.setdefault(pid, []).append(device)
    # every worker built the skeleton on meta; one of them (rank 0) also built it on the CPU
    assert len(devices) == 4 and all("meta" in each for each in devices.values()), devices
    assert sorted(each.count("cpu") for each in devices.values()) == [0, 0, 0, 1], devices


class TwiceTheSameLayer(nn.Module):
    """Two linear maps that share one weight (a tied pair inside one top-level layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def tied_deep_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), TwiceTheSameLayer(), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.slow
def test_a_stage_whose_layers_share_a_weight_keeps_it_shared_on_every_rank(tmp_path):
    """A stage allocated afresh would split a shared weight in two (its replicas' gradient
    sums then disagree in size): such a model is built whole on every rank, and trains to
    single-process SGD's weights."""
    shards = make_shards([30, 22, 17, 9])
    settings = {"stages": 2, "microbatches": 2, "pipeline_schedule": "gpipe", "shuffle": False}
    state, _ = train(shards, tmp_path, model_fn=tied_deep_net, batch_size=8, epochs=1, **settings)
    expected = reference_sgd(shards, 8, 1, 0, LR, MOMENTUM, False, model_fn=tied_deep_net)
    assert max_abs_diff(state, expected) < 1e-5
    assert torch.equal(state["2.first.weight"], state["2.second.weight"])


def head_tied_net() -> nn.Sequential:
    """The first layer's weight tied to the last's (a language model's embedding and head)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    net[4].weight = net[0].weight
    return net


@pytest.mark.slow
def test_a_weight_tied_across_stages_trains_as_one_tensor_to_single_process_sgds_weights(tmp_path):
    """Cut onto two stages, the tie's layers each hold a copy; their gradients are summed
    over the two stages every step (and counted once in the clipping norm), so the copies
    take the same steps and stay one tensor: single-process SGD's weights."""
    from sparkdl.strategies.pipeline_stage import cross_stage_ties

    (tie,) = cross_stage_ties(head_tied_net(), [0, 3, 5])
    assert tie.names == ("0.weight", "4.weight") and tie.stages == (0, 1)
    assert cross_stage_ties(head_tied_net(), [0, 5]) == []  # one stage: it stays one parameter
    shards = make_shards([30, 22, 17, 9])
    settings = {"stages": 2, "microbatches": 2, "pipeline_schedule": "1f1b", "shuffle": True}
    state, _ = train(shards, tmp_path, model_fn=head_tied_net, batch_size=8, epochs=2, **settings)
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, True, model_fn=head_tied_net)
    assert max_abs_diff(state, expected) < 1e-5
    assert torch.equal(state["0.weight"], state["4.weight"])


@pytest.mark.slow
def test_a_pipelines_checkpoint_resumes_under_all_reduce(tmp_path):
    """The checkpoint of a crashed pipeline run (the whole model and the whole optimizer
    state, numbered as the whole model's) resumes to the same weights under all-reduce,
    and an all-reduce checkpoint resumes under a pipeline."""
    shards = make_shards([50, 21])
    settings = {"batch_size": 8, "epochs": 2, "shuffle": True, "checkpoint_every": 2}
    marker = tmp_path / "drill"
    config = SparkDLConfig().replace(
        num_workers=2,
        collective_timeout_s=10.0,
        strategy="pipeline",
        microbatches=4,
        checkpoint_dir=str(tmp_path / "ckpt"),
        fault_injection=f"raise:1:11:{marker}",  # epoch 2, after the checkpoint of step 10
        **settings,
    )
    plan, template = shard_plan(shards)
    parts = [[shard_to_batch(x, y)] for x, y in shards]
    failed = spawn(parts, TrainSpec(config, make_deep_net, _adam, "cross_entropy", plan, template), tmp_path)
    assert "fault drill: rank 1 raised at step 11" in str(failed[1][1])
    assert CheckpointStore(str(tmp_path / "ckpt")).latest() == 10
    settings.pop("checkpoint_every")
    resumed, _ = run_workers(
        shards, tmp_path / "allreduce", _adam, model_fn=make_deep_net,
        checkpoint_dir=str(tmp_path / "ckpt"), **settings,
    )  # fmt: skip
    uninterrupted, _ = run_workers(shards, tmp_path / "plain", _adam, model_fn=make_deep_net, **settings)
    assert max_abs_diff(resumed, uninterrupted) < 1e-5


@pytest.mark.slow
def test_an_all_reduce_checkpoint_resumes_under_a_pipeline(tmp_path):
    shards = make_shards([50, 21])
    settings = {"batch_size": 8, "epochs": 2, "shuffle": True}
    marker = tmp_path / "drill"
    config = SparkDLConfig().replace(
        num_workers=2, collective_timeout_s=10.0, checkpoint_every=2, checkpoint_dir=str(tmp_path / "ckpt"),
        fault_injection=f"raise:0:11:{marker}", **settings,
    )  # fmt: skip
    plan, template = shard_plan(shards)
    parts = [[shard_to_batch(x, y)] for x, y in shards]
    failed = spawn(parts, TrainSpec(config, make_deep_net, _adam, "cross_entropy", plan, template), tmp_path)
    assert "fault drill: rank 0 raised at step 11" in str(failed[0][1])
    assert CheckpointStore(str(tmp_path / "ckpt")).latest() == 10
    resumed, results = train(
        shards,
        tmp_path / "pipeline",
        _adam,
        microbatches=4,
        checkpoint_dir=str(tmp_path / "ckpt"),
        **settings,
    )
    assert results[0][0][-1]["resumed_from_step"] == 10
    uninterrupted, _ = run_workers(shards, tmp_path / "plain", _adam, model_fn=make_deep_net, **settings)
    assert max_abs_diff(resumed, uninterrupted) < 1e-5


@pytest.mark.slow
def test_a_pipeline_with_adam_clipping_and_accumulation_equals_all_reduce(tmp_path):
    shards = make_shards([45, 30])
    settings = {"batch_size": 4, "accumulate_steps": 2, "epochs": 2, "grad_clip_norm": 0.05, "shuffle": True}
    state, results = train(shards, tmp_path / "pipeline", _adam, microbatches=3, **settings)
    expected, reference = run_workers(
        shards, tmp_path / "allreduce", _adam, model_fn=make_deep_net, **settings
    )
    assert max_abs_diff(state, expected) < 1e-5
    # the epochs' losses too (the schedule's shape inference calls the loss on made-up rows first)
    losses = [h["loss"] for h in results[0][0]]
    assert losses == pytest.approx([h["loss"] for h in reference[0][1]], rel=1e-6)


class Poison(nn.Module):
    """NaN for a row whose first feature is above 100 (a NaN loss the feed cannot see)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.where(
            x[:, :1] > 100, torch.full_like(x[:, :1], float("nan")), torch.zeros_like(x[:, :1])
        )


def make_poison_net() -> nn.Module:
    return nn.Sequential(Poison(), *make_deep_net())


@pytest.mark.slow
def test_a_nan_on_one_pipeline_is_skipped_by_every_rank_alike(tmp_path):
    shards = make_shards([16, 16, 16, 16])
    shards[3][0][9, 0] = 1000.0  # step 2 of pipeline 1
    config = SparkDLConfig().replace(
        num_workers=4, collective_timeout_s=30.0, strategy="pipeline", stages=2, microbatches=2,
        batch_size=8, epochs=1, shuffle=False, on_nan_loss="skip",
    )  # fmt: skip
    plan, template = shard_plan(shards)
    spec = TrainSpec(config, make_poison_net, _sgd, "cross_entropy", plan, template)
    state: dict = {}
    results = spawn([[shard_to_batch(x, y)] for x, y in shards], spec, tmp_path, weights=state)
    assert all(e is None for _, e, _ in results.values()), results
    assert [results[r][0][0]["nan_skips"] for r in range(4)] == [1, 1, 1, 1]
    clean = make_shards([16, 16, 16, 16])
    expected = reference_sgd(
        [(x[:8], y[:8]) for x, y in clean], 8, 1, 0, LR, MOMENTUM, False, make_poison_net
    )
    assert max_abs_diff(state, expected) < 1e-5  # step 1 only: step 2 reached no weights


@pytest.mark.slow
def test_validation_and_early_stopping_run_the_whole_pipeline_as_all_reduce_does(tmp_path):
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
    for strategy in ("pipeline", "allreduce"):
        config = SparkDLConfig().replace(
            num_workers=2, collective_timeout_s=30.0, strategy=strategy, batch_size=8, epochs=3,
            inference_batch_size=4, early_stopping_patience=1, optimizer="adam", lr=0.5,
        )  # fmt: skip
        spec = TrainSpec(config, make_deep_net, None, "cross_entropy", plan, template)
        weights: dict = {}
        results = spawn(parts, spec, tmp_path / strategy, weights=weights)
        assert all(e is None for _, e, _ in results.values()), results
        figures[strategy] = (
            [(h["val_loss"], h["val_samples"], h.get("restored_epoch")) for h in results[0][0]],
            weights,
        )
    (pipe, pipe_weights), (ar, ar_weights) = figures["pipeline"], figures["allreduce"]
    assert [f[1] for f in pipe] == [23] * len(pipe)
    # Adam at lr 0.5 magnifies the different order of float sums (micro-batches, then stages)
    assert [f[0] for f in pipe] == pytest.approx([f[0] for f in ar], rel=1e-4)
    assert [f[2] for f in pipe] == [f[2] for f in ar]
    assert pipe[-1][2] is not None  # early stopping restored a best epoch, gathered and spread
    assert max_abs_diff(pipe_weights, ar_weights) < 1e-4  # the best epoch's weights, restored


def test_a_model_a_pipeline_cannot_cut_is_refused_on_the_driver_naming_the_fix():
    from sparkdl.strategies.pipeline import PipelineStrategy
    from tests.reference import make_tiny_net

    config = SparkDLConfig().replace(strategy="pipeline", num_workers=2)
    with pytest.raises(
        ConfigError,
        match=r"or a Hugging Face decoder with a pipeline plan \(it returned TinyNet\)",
    ):
        PipelineStrategy.check_model(make_tiny_net(), config)
    flat = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3), nn.Tanh())
    with pytest.raises(
        ConfigError, match=r"stage 2 of 2 would hold only layers without trainable parameters \(2\)"
    ):
        PipelineStrategy.check_model(flat, config.replace(split_before=("2",)))
    PipelineStrategy.check_model(make_deep_net(), config)  # balanced: accepted


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "settings"),
    [
        ("pipeline", {"stages": 2, "microbatches": 2, "pipeline_schedule": "1f1b"}),  # 2 stages x 2 replicas
        ("tensor", {"tp_size": 2}),  # 2 groups of 2
        ("fsdp", {}),
    ],
)
def test_the_cost_model_counts_the_bytes_each_worker_sends(tmp_path, strategy, settings):
    """The cost model's bytes per step, from the model's shape (:func:`model_shape`), are what
    every rank's traffic counter counted, on 4 workers of even partitions."""
    shards = make_shards([32, 32, 32, 32])
    _, results = train(shards, tmp_path, batch_size=8, epochs=2, strategy=strategy, **settings)
    config = SparkDLConfig().replace(num_workers=4, strategy=strategy, **settings)
    x, y = shards[0]
    batch = Batch({"features": torch.from_numpy(x)}, torch.from_numpy(y))
    shape = model_shape(make_deep_net(), batch, config, 4)
    params = sum(p.numel() for p in make_deep_net().parameters())
    if strategy == "pipeline":
        assert shape.stages == 2 and shape.cut_bytes == (32.0,)  # 8 float32 after the second layer
        expected = pipeline_bytes(shape, 8, replicas=2) * 2  # ranks 0, 1: one pipeline; 2, 3 the other
    elif strategy == "tensor":
        assert shape.split_collectives == 3  # 2 pairs: 2 outputs, 1 input gradient (not the model's input)
        expected = [tensor_bytes(shape, params, 8, group=2, replicas=2)] * 4
    else:
        expected = [full_shard_bytes(4 * params, 4)] * 4
    # fsdp's counter counts FSDP's own collectives: the shards padded to split in 4, the root's
    # parameters gathered once (kept from forward to backward); the model says 3 (N-1)/N
    close = {"rel": 0.05} if strategy == "fsdp" else {"abs": 4}
    for rank, (history, _, _) in results.items():
        epoch = history[1]  # the first also holds the start's forward of the template rows
        assert epoch["steps"] == 4
        assert epoch["bytes_sent"] == pytest.approx(4 * expected[rank], **close), rank
