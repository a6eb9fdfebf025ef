"""Activation checkpointing (``training.activation_checkpointing``): which layers recompute,
that the gradients do not change, and the same weights as single-process SGD in every
strategy, on real gloo process groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparkdl.training.factory import checkpoint_layers
from tests.reference import make_deep_net, make_shards, make_tiny_net, max_abs_diff, reference_sgd
from tests.unit.test_worker_gloo import LR, MOMENTUM, run_workers


class Counted(nn.Module):
    """A layer that counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return torch.tanh(self.linear(x))


def test_each_layer_with_parameters_recomputes_in_backward_to_the_same_gradients():
    torch.manual_seed(0)
    plain = nn.Sequential(Counted(), nn.ReLU(), Counted(), nn.Linear(4, 2))
    checked = nn.Sequential(Counted(), nn.ReLU(), Counted(), nn.Linear(4, 2))
    checked.load_state_dict(plain.state_dict())
    assert checkpoint_layers(checked) == ["0", "2", "3"]  # the ReLU has nothing to keep
    x = torch.randn(5, 4)
    for model in (plain, checked):
        model(x).square().sum().backward()
    assert [plain[0].forwards, checked[0].forwards] == [1, 2]  # recomputed once in backward
    for (name, a), (_, b) in zip(plain.named_parameters(), checked.named_parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-7), name
    assert list(checked.state_dict()) == list(plain.state_dict())  # names unchanged


def test_a_model_wrapping_one_sequential_checkpoints_the_sequentials_layers():
    assert checkpoint_layers(make_tiny_net()) == ["body.0", "body.2"]
    assert checkpoint_layers(nn.Sequential(nn.Linear(4, 4))) == ["0"]  # a stage of one layer


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [
        {"strategy": "allreduce"},
        {"strategy": "weight_averaging", "sync_every": 1},
        {"strategy": "parameter_server", "ps_mode": "sync"},
        {"strategy": "fsdp"},
        {"strategy": "pipeline", "microbatches": 3},
        {"strategy": "tensor"},
    ],
    ids=lambda s: s["strategy"],
)
def test_every_strategy_with_checkpointed_activations_gives_single_process_sgds_weights(tmp_path, settings):
    shards = make_shards([40, 23])
    state, _ = run_workers(
        shards, tmp_path, model_fn=make_deep_net, batch_size=8, epochs=2, shuffle=True,
        activation_checkpointing=True, **settings,
    )  # fmt: skip
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, True, model_fn=make_deep_net)
    assert max_abs_diff(state, expected) < 1e-5
