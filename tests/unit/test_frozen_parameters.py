"""Frozen parameters (``requires_grad = False``: a LoRA model's base) are neither sent nor
served, in every data-parallel strategy: two workers on loopback gloo give single-process
SGD's weights, the frozen weights stay as model_fn built them, and the bytes each worker
sends fall to what the trainable parameters weigh."""

from __future__ import annotations

import io
import random

import pytest
import torch
from torch import nn

from sparkdl.services.ps.protocol import PS_WIRE
from sparkdl.services.ps.sharding import shard_trainable
from sparkdl.wire.framing import frame_bytes
from tests.reference import make_shards, max_abs_diff, reference_sgd
from tests.unit.test_worker_gloo import _plain_sgd, _sgd, _worker_sending_its_weights, run_workers

LR, MOMENTUM = 0.1, 0.9


def _net(frozen: bool) -> nn.Module:
    """A head on two wide layers, frozen or not: 195 of 4,803 parameters train when frozen."""
    model = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    if frozen:
        for layer in (model[0], model[2]):
            layer.requires_grad_(False)
    return model


def make_frozen_net() -> nn.Module:
    return _net(frozen=True)


def make_open_net() -> nn.Module:
    return _net(frozen=False)


def _trainable_bytes(model_fn) -> tuple[int, int]:
    model = model_fn()
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() * 4 for p in model.parameters())


def _frozen_as_built(state, model_fn, seed=0):
    torch.manual_seed(seed)
    built = model_fn()
    return all(torch.equal(state[n], p) for n, p in built.named_parameters() if not p.requires_grad)


STRATEGIES = [
    {"strategy": "allreduce"},
    {"strategy": "weight_averaging", "sync_every": 1},
    {"strategy": "parameter_server", "ps_mode": "sync", "shared_memory": False},
]


@pytest.mark.slow
@pytest.mark.parametrize("settings", STRATEGIES, ids=lambda s: s["strategy"])
def test_a_model_with_frozen_layers_trains_to_single_process_sgds_weights_and_keeps_them_frozen(
    tmp_path, settings
):
    shards = make_shards([48, 48])
    state, _ = run_workers(
        shards, tmp_path, _sgd, model_fn=make_frozen_net, batch_size=8, epochs=2, shuffle=True, **settings
    )
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, True, model_fn=make_frozen_net)
    assert max_abs_diff(state, expected) < 1e-5
    assert _frozen_as_built(state, make_frozen_net)
    assert not torch.equal(state["4.weight"], make_frozen_net()[4].weight)  # the head did train


@pytest.mark.slow
@pytest.mark.parametrize("settings", STRATEGIES, ids=lambda s: s["strategy"])
def test_the_bytes_sent_fall_to_what_the_trainable_parameters_weigh(tmp_path, settings):
    shards = make_shards([32, 32])
    sent = {}
    for name, model_fn in (("frozen", make_frozen_net), ("open", make_open_net)):
        _, results = run_workers(
            shards, tmp_path / name, _plain_sgd, model_fn=model_fn, batch_size=8, epochs=1, **settings
        )
        sent[name] = results[0][1][0]["bytes_sent"]
    trainable, whole = _trainable_bytes(make_frozen_net)
    assert (trainable, whole) == (195 * 4, 4803 * 4)
    steps = 4
    if settings["strategy"] == "parameter_server":  # one shard: a PUSH of the gradients and a PULL a step
        pull = frame_bytes(PS_WIRE.header.size, 0)
        for name, payload in (("frozen", trainable), ("open", whole)):
            assert sent[name] == pull + steps * (frame_bytes(PS_WIRE.header.size, payload) + pull)
    else:  # a ring of two sends the payload once a step (plain SGD: no optimizer state to average)
        assert (sent["frozen"], sent["open"]) == (steps * trainable, steps * whole)


def test_the_parameter_server_shards_only_the_trainable_parameters_numbered_as_the_worker_numbers_them():
    params = list(make_frozen_net().parameters())
    groups = shard_trainable(params, 2)
    assert sorted(i for g in groups for i in g) == [4, 5]  # the head's weight and bias
    assert shard_trainable(list(make_open_net().parameters()), 1) == [[0, 1, 2, 3, 4, 5]]


def make_lora_classifier() -> nn.Module:
    return _TinyGpt(lora=True)


def make_full_classifier() -> nn.Module:
    return _TinyGpt(lora=False)


class _TinyGpt(nn.Module):
    """A 2-layer GPT-2 (n_embd 32, dropout off) reading each of a row's 6 features as one
    position, its last position classified; with ``lora``, PEFT's LoRA (r 4) on the attention's
    q/k/v projection, the base frozen."""

    def __init__(self, lora: bool) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2Model

        config = GPT2Config(
            vocab_size=8, n_positions=8, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0
        )
        config.attn_pdrop = 0.0
        base = GPT2Model(config)
        base.wte.requires_grad_(False)  # rows come in as inputs_embeds: the token embedding is unused
        if lora:
            from peft import LoraConfig, get_peft_model

            adapter = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0)
            base = get_peft_model(base, adapter)
        self.embed = nn.Linear(1, 32)
        self.body = base
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.body(inputs_embeds=self.embed(x.unsqueeze(-1))).last_hidden_state
        return self.head(hidden[:, -1])


@pytest.mark.slow
@pytest.mark.parametrize("settings", STRATEGIES, ids=lambda s: s["strategy"])
def test_peft_lora_on_a_tiny_gpt2_trains_as_one_process_and_sends_only_the_adapters(tmp_path, settings):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    shards = make_shards([16, 16])
    state, results = run_workers(
        shards,
        tmp_path,
        _plain_sgd,
        model_fn=make_lora_classifier,
        batch_size=8,
        epochs=1,
        shuffle=False,
        **settings,
    )
    expected = reference_sgd(shards, 8, 1, 0, LR, 0.0, False, model_fn=make_lora_classifier)
    assert max_abs_diff(state, expected) < 1e-5
    assert _frozen_as_built(state, make_lora_classifier)
    trainable, _ = _trainable_bytes(make_lora_classifier)
    _, whole = _trainable_bytes(make_full_classifier)
    assert trainable < whole / 10  # embed, adapters, head
    sent = results[0][1][0]["bytes_sent"]
    if settings["strategy"] == "parameter_server":
        pull = frame_bytes(PS_WIRE.header.size, 0)
        assert sent == pull + 2 * (frame_bytes(PS_WIRE.header.size, trainable) + pull)
    else:
        assert sent == 2 * trainable


def _frozen_by_pid() -> nn.Module:
    """:func:`make_frozen_net` whose frozen layers are drawn with Python's random, which the
    worker does not seed: a model_fn that builds different frozen weights on each worker."""
    model = make_frozen_net()
    draw = random.Random()  # seeded from the OS: differs in every process
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.copy_(
                torch.tensor([draw.gauss(0, 0.3) for _ in range(layer.weight.numel())]).view_as(layer.weight)
            )
    return model


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["allreduce", "weight_averaging"])
def test_workers_whose_frozen_weights_differ_all_take_rank_0s(tmp_path, strategy):
    _, results = run_workers(
        make_shards([16, 16]),
        tmp_path,
        model_fn=_frozen_by_pid,
        worker=_worker_sending_its_weights,
        strategy=strategy,
        batch_size=8,
        epochs=1,
    )
    states = [torch.load(io.BytesIO(results[r][0]), weights_only=True) for r in range(2)]
    assert max_abs_diff(states[0], states[1]) == 0.0


def _frozen_on_rank_1() -> nn.Module:
    import torch.distributed as dist

    return _net(frozen=dist.get_rank() == 1)


@pytest.mark.slow
def test_workers_that_freeze_different_parameters_are_told_which_rank_trains_what(tmp_path):
    with pytest.raises(
        AssertionError, match=r"do not train the same parameters \(rank 0: 6 tensors, 4803 values"
    ):
        run_workers(make_shards([16, 16]), tmp_path, model_fn=_frozen_on_rank_1, strategy="weight_averaging")


# ------------------------------------------------------------------ fsdp


@pytest.mark.slow
def test_fsdp_trains_frozen_layers_to_single_process_sgds_weights_and_checkpoints_each_weight_once(tmp_path):
    from tests.unit.test_fsdp import train as train_fsdp

    shards = make_shards([48, 40])
    settings = {"batch_size": 8, "epochs": 2, "shuffle": True}
    state, _ = train_fsdp(shards, tmp_path, _sgd, model_fn=make_frozen_net, **settings)
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, True, model_fn=make_frozen_net)
    assert max_abs_diff(state, expected) < 1e-5
    assert _frozen_as_built(state, make_frozen_net)
    # the checkpoint (train_fsdp: equal to the returned weights) holds the model's names once each
    assert sorted(state) == sorted(make_frozen_net().state_dict())
    assert not torch.equal(state["4.weight"], make_frozen_net()[4].weight)  # the head did train


@pytest.mark.slow
def test_under_fsdp_frozen_layers_are_gathered_but_their_gradients_never_reduce_scattered(tmp_path):
    from tests.unit.test_fsdp import train as train_fsdp

    shards = make_shards([32, 32])
    sent = {}
    for name, model_fn in (("frozen", make_frozen_net), ("open", make_open_net)):
        _, results = train_fsdp(
            shards, tmp_path / name, _plain_sgd, model_fn=model_fn, batch_size=8, epochs=1
        )
        sent[name] = results[0][0][0]["bytes_sent"]
    # Counted as FSDP runs them, per rank of 2: each collective sends half its tensor. Units: the
    # first layer (448 values), the second (4,160), the root holding the head (195, its 3 rows
    # padded to 4 to split in 2: 260); the root stays gathered from forward to backward.
    first, second, head = 448 * 4, 4160 * 4, 260 * 4
    before = (first + second) // 2  # one forward before the first step
    steps = 4
    # Fully trained: each unit gathered for forward and again for backward (the root once),
    # every gradient reduce-scattered.
    assert sent["open"] == before + steps * (3 * first + 3 * second + 2 * head) // 2
    # Frozen: the first layer gathered once (its input needs no gradient, so backward never
    # reaches it), the second twice (backward passes through it), and only the head's gradient
    # reduce-scattered.
    assert sent["frozen"] == before + steps * (first + 2 * second + 2 * head) // 2
