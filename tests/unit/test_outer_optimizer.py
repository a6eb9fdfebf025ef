"""Weight averaging's outer optimizer (DiLoCo), and optimizer state under compression.

The outer step alone against ``torch.optim.SGD(nesterov=True)``; then spawned workers on
real gloo groups running ``run_worker`` as barrier tasks do (test_worker_gloo's helpers):
the outer optimizer at lr 1 / momentum 0 is plain averaging to the bit, it resumes from a
checkpoint with its momentum, and every named optimizer trains a real data set through
every lossy codec without a non-finite step.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from sparkdl.config import SparkDLConfig
from sparkdl.errors import ConfigError
from sparkdl.storage.checkpoint_store import CheckpointStore
from sparkdl.strategies.outer import CHECKPOINT_KEY, NesterovOuterStep
from tests.reference import make_shards, max_abs_diff
from tests.unit.test_worker_gloo import _worker_sending_its_weights, run_workers


def _rounds(seed: int, rounds: int, shape=(3, 4)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(rounds)]


def test_the_outer_step_is_nesterov_sgd_on_the_rounds_pseudo_gradient():
    start = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    weights = start.clone()
    outer = NesterovOuterStep([weights], lr=0.7, momentum=0.9)
    reference = nn.Parameter(start.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for change in _rounds(1, 5):
        weights.add_(change)  # the round's average: the workers moved the weights by `change`
        reference.grad = -change  # torch's SGD sees the pseudo-gradient ref - avg
        sgd.step()
        outer.step()
        torch.testing.assert_close(weights, reference.detach(), rtol=0, atol=1e-6)
    assert not torch.equal(weights, start + sum(_rounds(1, 5)))  # it is not the plain average


def test_lr_one_without_momentum_leaves_the_average_to_the_last_bit():
    weights = torch.randn(50, generator=torch.Generator().manual_seed(2))
    outer = NesterovOuterStep([weights], lr=1.0, momentum=0.0)
    for change in _rounds(3, 4, shape=(50,)):
        weights.add_(change * 1e-3)
        average = weights.clone()
        outer.step()
        assert torch.equal(weights, average)


def test_a_checkpoints_momentum_is_taken_up_and_a_wrong_one_is_named():
    weights = torch.zeros(2, 2)
    outer = NesterovOuterStep([weights], lr=0.5, momentum=0.9, velocity=[torch.ones(2, 2)])
    weights.sub_(1.0)  # delta = +1: v = 0.9 * 1 + 1 = 1.9; new = 0 - 0.5 * (1 + 0.9 * 1.9)
    outer.step()
    assert torch.allclose(weights, torch.full((2, 2), -0.5 * (1 + 0.9 * 1.9)))
    assert torch.allclose(outer.velocity()[0], torch.full((2, 2), 1.9))
    with pytest.raises(ValueError, match=r"outer momentum has 1 tensors .* the model 1 parameters"):
        NesterovOuterStep([torch.zeros(3)], lr=0.5, momentum=0.9, velocity=[torch.ones(2, 2)])


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"outer_momentum": 1.0}, "outer_momentum = 1.0 must be below 1"),
        ({"outer_lr": 0.0}, "outer_lr = 0.0 must be > 0"),
        ({"outer_optimizer": "adam"}, "outer_optimizer"),
    ],
)
def test_bad_outer_settings_fail_when_the_config_is_built(setting, message):
    with pytest.raises(ConfigError, match=message):
        SparkDLConfig().replace(strategy="weight_averaging", **setting)


# --- spawned workers --------------------------------------------------------------------

WA = {"strategy": "weight_averaging", "sync_every": 2, "batch_size": 8, "shuffle": True, "seed": 0}


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["none", "1bit"])
def test_outer_lr_one_without_momentum_is_plain_averaging_bit_for_bit(tmp_path, compression):
    shards = make_shards([50, 21])
    settings = {**WA, "epochs": 2, "compression": compression}
    plain, _ = run_workers(shards, tmp_path / "plain", **settings)
    outer, _ = run_workers(
        shards, tmp_path / "outer", outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, **settings
    )
    assert all(torch.equal(plain[name], outer[name]) for name in plain), max_abs_diff(plain, outer)
    if compression == "none":
        moved, _ = run_workers(shards, tmp_path / "moved", outer_optimizer="nesterov", **settings)
        assert max_abs_diff(plain, moved) > 1e-3  # the paper's 0.7 / 0.9 is another trajectory


@pytest.mark.slow
def test_with_one_bit_pseudo_gradients_every_worker_ends_with_the_same_weights(tmp_path):
    shards = make_shards([50, 21])
    settings = {**WA, "epochs": 2, "compression": "1bit", "outer_optimizer": "nesterov"}
    _, results = run_workers(shards, tmp_path, worker=_worker_sending_its_weights, **settings)
    ranks = [torch.load(io.BytesIO(results[rank][0]), weights_only=True) for rank in (0, 1)]
    assert all(torch.equal(ranks[0][name], ranks[1][name]) for name in ranks[0])
    plain, _ = run_workers(shards, tmp_path / "plain", **{**settings, "outer_optimizer": "none"})
    assert max_abs_diff(ranks[0], plain) > 1e-3  # the outer step ran


@pytest.mark.slow
def test_the_outer_optimizer_resumes_from_a_checkpoint_with_its_momentum(tmp_path):
    shards = make_shards([50, 21])
    settings = {**WA, "epochs": 2, "outer_optimizer": "nesterov"}
    marker = tmp_path / "drill"
    checkpoints = tmp_path / "ckpt"
    resumable = {**settings, "checkpoint_dir": str(checkpoints), "checkpoint_every": 4}
    drill = f"raise:1:9:{marker}"
    failed = run_workers_failing(shards, tmp_path / "failed", fault_injection=drill, **resumable)
    assert "fault drill: rank 1 raised at step 9" in failed
    saved = CheckpointStore(str(checkpoints))
    assert saved.latest() == 8
    state = saved.load(8)
    assert len(state["strategy"][CHECKPOINT_KEY]) == 4  # every parameter's momentum (TinyNet: 2 layers)
    state["strategy"].pop(CHECKPOINT_KEY)  # the same checkpoint without the momentum, to show it is used
    without_momentum = tmp_path / "without"
    CheckpointStore(str(without_momentum)).save(8, state)
    resumed, results = run_workers(shards, tmp_path / "resumed", **resumable)
    assert results[0][1][-1]["resumed_from_step"] == 8
    uninterrupted, _ = run_workers(shards, tmp_path / "uninterrupted", **settings)
    assert max_abs_diff(resumed, uninterrupted) < 1e-6
    forgetful, _ = run_workers(
        shards, tmp_path / "forgetful", **{**resumable, "checkpoint_dir": str(without_momentum)}
    )
    assert max_abs_diff(forgetful, uninterrupted) > 1e-4


def run_workers_failing(shards, tmp_path, **settings) -> str:
    with pytest.raises(AssertionError) as failed:
        run_workers(shards, tmp_path, **settings)
    return str(failed.value)


# --- optimizer state through lossy codecs -------------------------------------------------


def breast_cancer():
    """scikit-learn's breast cancer data, standardized, 2 shards and a held-out part."""
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order].astype(np.int64)
    x = ((x - x[:450].mean(0)) / x[:450].std(0)).astype(np.float32)
    shards = [(x[:450][r::2], y[:450][r::2]) for r in range(2)]
    return shards, (torch.from_numpy(x[450:]), torch.from_numpy(y[450:]))


def cancer_net() -> nn.Module:
    return nn.Sequential(nn.Linear(30, 16), nn.ReLU(), nn.Linear(16, 2))


def held_out_accuracy(state, held_out) -> float:
    model = cancer_net()
    model.load_state_dict(state)
    x, y = held_out
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


OPTIMIZERS = {  # name: (settings, lr)
    "sgd": ({"optimizer": "sgd"}, 0.1),
    "sgd momentum": ({"optimizer": "sgd", "momentum": 0.9}, 0.02),
    "adam": ({"optimizer": "adam"}, 0.01),
    "adamw": ({"optimizer": "adamw"}, 0.01),
    "adagrad": ({"optimizer": "adagrad"}, 0.05),
}
CODECS = ["fp16", "bf16", "1bit", "topk"]
#: In the default run: the issue's case, and each state that must stay positive through a lossy codec.
DEFAULT_CASES = [
    ("weight_averaging", "adam", "1bit"),  # the case: it failed at epoch 1, step 9
    ("weight_averaging", "adagrad", "topk"),
    ("weight_averaging", "adamw", "fp16"),
]  # the parameter server keeps the optimizer's state on the server: the rest of the matrix
EVERY_CASE = [
    pytest.param(strategy, optimizer, codec, marks=[] if (strategy, optimizer, codec) in DEFAULT_CASES
                 else [pytest.mark.full_matrix])
    for strategy in ("weight_averaging", "parameter_server")
    for optimizer in OPTIMIZERS
    for codec in CODECS
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "optimizer", "compression"), EVERY_CASE)
def test_every_named_optimizer_trains_through_every_codec_without_a_non_finite_step(
    tmp_path, strategy, optimizer, compression
):
    """Optimizer state that must stay positive never goes through a lossy codec (the rest
    of the matrix: ``pytest -m full_matrix``)."""
    shards, held_out = breast_cancer()
    settings, lr = OPTIMIZERS[optimizer]
    state, results = run_workers(
        shards,
        tmp_path,
        optimizer_fn=None,
        model_fn=cancer_net,
        strategy=strategy,
        sync_every=4,
        batch_size=16,
        epochs=3,
        lr=lr,
        compression=compression,
        topk_ratio=0.1,  # 53 of this model's 530 values a round (1% would keep 5)
        seed=0,
        **settings,
    )
    assert [h["nan_skips"] for h in results[0][1]] == [0, 0, 0]  # and no rank stopped on one
    assert held_out_accuracy(state, held_out) >= 0.92  # 0.63 for the majority class
