"""Sufficient factors (runtime.sufficient_factors): fully connected layers' gradients sent as
each row's input and output gradient, rebuilt exactly on every worker."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparkdl.comm.exchange import FlatExchange
from sparkdl.comm.factors import FactorCapture, Factors, factorable
from sparkdl.comm.traffic import factors_pay, ring_allreduce_bytes
from sparkdl.config import SparkDLConfig, SufficientFactors
from sparkdl.errors import ConfigError
from sparkdl.services.ps.factored import FACTORS, FactorLayout
from sparkdl.strategies import check_settings
from tests.reference import make_shards, make_tiny_net, max_abs_diff, reference_sgd
from tests.unit.test_worker_gloo import LR, MOMENTUM, _plain_sgd, run_workers


def test_factors_pay_where_a_ring_all_gather_of_the_rows_is_smaller_than_the_matrixs_all_reduce():
    # Two workers: Poseidon's B (M + N) < M N.
    assert factors_pay(32, 4096, 4096, 2)  # 32 * 8192 = 1/16 of 4096^2
    assert not factors_pay(8, 6, 8, 2)  # 8 * 14 = 112 > 48
    assert factors_pay(63, 128, 128, 2) and not factors_pay(64, 128, 128, 2)  # the boundary: 64 * 256 = 128^2
    # More workers gather more rows: the same layer stops paying sooner.
    assert factors_pay(32, 512, 512, 2) and not factors_pay(32, 512, 512, 16)
    assert not factors_pay(1, 4096, 4096, 1)  # a single worker sends nothing either way


class _SeqNet(nn.Module):
    """Linear layers on sequences (rows x tokens x features), one of them applied twice."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.mid, self.down = nn.Linear(5, 12), nn.Linear(12, 12), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        h = torch.tanh(self.mid(torch.tanh(self.mid(h))))  # the same layer twice: two backward passes
        return self.down(h).mean(dim=1)


def test_factors_rebuild_autograds_gradient_over_micro_batches_tokens_and_a_reused_layer():
    torch.manual_seed(0)
    model = _SeqNet()
    expected_model = _SeqNet()
    expected_model.load_state_dict(model.state_dict())
    factors = Factors(model, FlatExchange(world_size=1), SufficientFactors.ON, rows_hint=4)
    assert factors.weight_names == ["up.weight", "mid.weight", "down.weight"]
    batches = [torch.randn(4, 7, 5), torch.randn(3, 7, 5)]  # two micro-batches of 7 tokens
    for x in batches:
        model(x).square().sum().backward()
        expected_model(x).square().sum().backward()
    for name in factors.weight_names:  # autograd's own gradient, before the rebuild replaces it
        assert dict(model.named_parameters())[name].grad is not None
    factors.sum_gradients()
    got = {n: p.grad for n, p in model.named_parameters()}
    want = {n: p.grad for n, p in expected_model.named_parameters()}
    assert max_abs_diff(got, want) < 1e-5
    with torch.no_grad():  # inference captures nothing
        model(batches[0])
    assert all(not layer.rows for layer in factors._layers)
    factors.close()


def test_a_weight_shared_by_two_linear_layers_keeps_its_matrix():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    factors = Factors(model, FlatExchange(world_size=1), SufficientFactors.ON, rows_hint=4)
    assert factors.weight_names == []


@pytest.mark.parametrize(
    ("settings", "fix"),
    [
        ({"strategy": "weight_averaging"}, "sufficient_factors = 'off'"),
        ({"strategy": "fsdp"}, "only 'allreduce'"),
        ({"hierarchy": "host"}, "hierarchy = 'host'"),
    ],
)
def test_what_sufficient_factors_cannot_combine_with_is_refused_with_the_fix(settings, fix):
    with pytest.raises(ConfigError, match=fix):
        check_settings(SparkDLConfig().replace(sufficient_factors="on", **settings))


def make_wide_net() -> nn.Module:
    """Three Linear layers; at 8 rows on two workers factors pay for the middle one alone."""
    return nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sizes", "mode", "model_fn"),
    [
        ([50, 21], "on", make_tiny_net),  # uneven: the short worker sends its filler's zero rows
        ([40, 0, 17], "on", make_wide_net),  # three workers, one without rows
        ([50, 21], "auto", make_wide_net),  # the middle layer as factors, the others in DDP's buckets
    ],
)
def test_sufficient_factors_give_single_process_sgds_weights(tmp_path, sizes, mode, model_fn):
    shards = make_shards(sizes)
    state, _ = run_workers(
        shards, tmp_path, model_fn=model_fn, sufficient_factors=mode, batch_size=8, epochs=2, shuffle=True
    )
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, True, model_fn=model_fn)
    assert max_abs_diff(state, expected) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "factored"), [("on", [(6, 64), (64, 64), (64, 3)]), ("auto", [(64, 64)])])
def test_the_bytes_counted_are_the_factors_rows_and_the_buckets_rest(tmp_path, mode, factored):
    """Two workers, 8 rows a step: each sends 8 (M + N) float32 per factored layer (a ring
    all-gather with one other worker) and all-reduces the remaining parameters in DDP's buckets."""
    shards = make_shards([64, 64])
    _, results = run_workers(
        shards,
        tmp_path,
        model_fn=make_wide_net,
        sufficient_factors=mode,
        shared_memory=False,
        batch_size=8,
        epochs=1,
    )
    epoch = results[0][1][0]
    weights = sum(m * n for m, n in factored)
    rest = sum(p.numel() for p in make_wide_net().parameters()) - weights
    per_step = sum(8 * (m + n) * 4 for m, n in factored) + ring_allreduce_bytes(rest * 4, 2)
    assert epoch["steps"] == 8
    assert epoch["bytes_sent"] == 8 * per_step
    _, plain = run_workers(
        shards, tmp_path / "plain", model_fn=make_wide_net, shared_memory=False, batch_size=8, epochs=1
    )
    assert plain[0][1][0]["bytes_sent"] == 8 * ring_allreduce_bytes((weights + rest) * 4, 2)


def _adam(params):
    return torch.optim.Adam(params, lr=0.01)


@pytest.mark.slow
def test_factors_with_adam_clipping_and_accumulation_equal_plain_all_reduce(tmp_path):
    shards = make_shards([50, 21])
    settings = {"batch_size": 4, "accumulate_steps": 2, "grad_clip_norm": 0.5, "epochs": 2}
    plain, _ = run_workers(shards, tmp_path / "plain", _adam, model_fn=make_wide_net, **settings)
    factored, _ = run_workers(
        shards, tmp_path / "factored", _adam, model_fn=make_wide_net, sufficient_factors="on", **settings
    )
    assert max_abs_diff(plain, factored) < 1e-5


def test_your_own_loop_refuses_sufficient_factors_before_any_task_starts():
    from sparkdl.worker.prepare import check_own_loop_settings

    with pytest.raises(ConfigError, match="sufficient_factors = 'off', or train with TorchEstimator"):
        check_own_loop_settings(SparkDLConfig().replace(sufficient_factors="auto"))
    check_own_loop_settings(SparkDLConfig())  # off: accepted


# -- the parameter server: factors in the push, the gradient rebuilt on the server -------------


def _shard_of_wide_net():
    model = make_wide_net()
    shapes = {id(layer.weight): (layer.in_features, layer.out_features) for _, layer in factorable(model)}
    return model, FactorLayout.of(list(model.parameters()), shapes)


def test_a_factored_push_decodes_to_the_whole_gradient():
    torch.manual_seed(1)
    model, layout = _shard_of_wide_net()
    assert layout.factorable == [0, 2, 4]  # the three weights; the biases travel whole
    capture = FactorCapture(factorable(model))
    model(torch.randn(5, 6)).square().sum().backward()
    whole = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    chosen = {2: capture.layers[1].factors()}  # the middle layer as factors, the others whole
    push = layout.encode(whole, chosen)
    assert push.code == FACTORS
    assert push.data.numel() == 4 * 3 + 4 * (layout.numel - 64 * 64) + 4 * 5 * (64 + 64)
    assert torch.allclose(layout.decode(push.data), whole, atol=1e-6)
    capture.close()


@pytest.mark.parametrize(
    ("tamper", "error"),
    [
        (lambda d: d[:-4], "bytes where its counts"),  # one value short
        (lambda d: torch.cat([torch.tensor([-2], dtype=torch.int32).view(torch.uint8), d[4:]]), "below -1"),
        (
            lambda d: torch.cat([torch.tensor([10**6], dtype=torch.int32).view(torch.uint8), d[4:]]),
            "no fewer",
        ),
        (lambda d: torch.cat([torch.tensor([2], dtype=torch.int32).view(torch.uint8), d[4:]]), "give"),
        (lambda d: d[:7], "cannot hold"),
    ],
)
def test_a_malformed_factored_push_is_refused_before_anything_is_built(tamper, error):
    _, layout = _shard_of_wide_net()
    whole = torch.zeros(layout.numel)
    push = layout.encode(whole, {2: (torch.zeros(3, 64), torch.zeros(3, 64))})
    with pytest.raises(ValueError, match=error):
        layout.decode(tamper(push.data))


def test_factors_no_smaller_than_their_matrix_are_refused_which_bounds_the_servers_rebuild():
    """A worker sends factors only where r (M + N) < M N; a push past that (a forged one, of
    a size consistent with its counts) would make the server rebuild more: refused."""
    _, layout = _shard_of_wide_net()
    whole = torch.zeros(layout.numel)
    fits = layout.encode(whole, {2: (torch.zeros(31, 64), torch.zeros(31, 64))})  # 31 x 128 < 64 x 64
    assert torch.equal(layout.decode(fits.data), whole)
    too_many = layout.encode(whole, {2: (torch.zeros(32, 64), torch.zeros(32, 64))})  # 32 x 128 = 64 x 64
    with pytest.raises(ValueError, match="32 rows of factors for a 64 x 64 weight"):
        layout.decode(too_many.data)


def test_the_parameter_server_refuses_factors_with_compression_and_says_which():
    with pytest.raises(ConfigError, match="either compressed or carries factors"):
        check_settings(
            SparkDLConfig().replace(strategy="parameter_server", sufficient_factors="on", compression="1bit")
        )


@pytest.mark.slow
@pytest.mark.parametrize(("sizes", "ps_shards"), [([50, 21], 1), ([40, 0, 17], 2)])
def test_a_parameter_server_fed_factors_gives_single_process_sgds_weights(tmp_path, sizes, ps_shards):
    shards = make_shards(sizes)
    state, _ = run_workers(
        shards,
        tmp_path,
        _plain_sgd,
        model_fn=make_wide_net,
        strategy="parameter_server",
        sufficient_factors="auto",
        ps_shards=ps_shards,
        batch_size=8,
        epochs=2,
        shuffle=True,
    )
    expected = reference_sgd(shards, 8, 2, 0, LR, 0.0, True, model_fn=make_wide_net)
    assert max_abs_diff(state, expected) < 1e-5


@pytest.mark.slow
def test_a_factored_push_saves_the_matrix_less_its_rows_factors(tmp_path):
    """Two workers, 8 rows a step, one shard: the middle layer (64 x 64) goes as 8 x (64 + 64)
    values, the others whole (their factors would be larger), plus one count per weight."""
    shards = make_shards([64, 64])
    common = {"strategy": "parameter_server", "ps_shards": 1, "ps_shared_memory_mb": 0, "batch_size": 8}
    common |= {"epochs": 1, "model_fn": make_wide_net}
    _, plain = run_workers(shards, tmp_path / "plain", _plain_sgd, **common)
    _, factored = run_workers(shards, tmp_path / "factored", _plain_sgd, sufficient_factors="on", **common)
    plain_epoch, factored_epoch = plain[0][1][0], factored[0][1][0]
    assert plain_epoch["pushes"] == factored_epoch["pushes"] == 8
    saved = 4 * (64 * 64 - 8 * (64 + 64)) - 4 * 3
    assert plain_epoch["bytes_sent"] - factored_epoch["bytes_sent"] == 8 * saved
    assert plain_epoch["bytes_received"] == factored_epoch["bytes_received"]  # the pulls are alike


# -- weights used by more than their layer (issue 52) ---------------------------------------------


class ReusedWeightNet(nn.Module):
    """The head's weight used twice: by its layer, and by a function of it in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        return self.head(h) + 0.5 * (h @ self.head.weight.t())


def test_a_weight_an_embedding_shares_keeps_its_matrix():
    """A language model's head tied to its embedding: the weight's gradient has the
    embedding's share too, which the head's factors would drop (the issue's max error 0.333)."""
    from tests.unit.test_tensor_models import TiedLM

    assert [name for name, _ in factorable(TiedLM())] == ["body.3.weight", "body.5.weight"]


def test_a_weight_used_by_a_function_too_is_found_at_the_first_step():
    model = ReusedWeightNet()
    factors = Factors(model, FlatExchange(world_size=1), SufficientFactors.ON, rows_hint=4)
    assert factors.weight_names == ["up.weight", "head.weight"]  # no module shows the second use
    model(torch.randn(5, 6)).square().sum().backward()
    with pytest.raises(ConfigError, match=r"the weight of \['head.weight'\] is used outside its nn.Linear"):
        factors.sum_gradients()
    plain = _SeqNet()
    checked = Factors(plain, FlatExchange(world_size=1), SufficientFactors.ON, rows_hint=4)
    plain(torch.randn(4, 7, 5)).square().sum().backward()
    checked.sum_gradients()  # a layer called twice is still its own rows' factors: accepted
    factors.close()
    checked.close()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["allreduce", "parameter_server"])
def test_a_tied_head_with_factors_gives_single_process_sgds_weights(tmp_path, strategy):
    from tests.unit.test_tensor_models import TiedLM

    shards = make_shards([40, 23])
    state, _ = run_workers(
        shards, tmp_path, _plain_sgd, model_fn=TiedLM, strategy=strategy, sufficient_factors="on",
        batch_size=8, epochs=2, shuffle=True,
    )  # fmt: skip
    expected = reference_sgd(shards, 8, 2, 0, LR, 0.0, True, model_fn=TiedLM)
    assert max_abs_diff(state, expected) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["allreduce", "parameter_server"])
def test_a_weight_used_by_a_function_too_stops_every_worker_at_the_first_step(tmp_path, strategy):
    shards = make_shards([16, 16])
    with pytest.raises(
        AssertionError, match=r"the weight of \['head.weight'\] is used outside its nn.Linear"
    ):
        run_workers(
            shards, tmp_path, _plain_sgd, model_fn=ReusedWeightNet, strategy=strategy,
            sufficient_factors="on", batch_size=8, epochs=1,
        )  # fmt: skip


class CalledAsAFunction(nn.Module):
    """A layer never called: its weight used by a function alone (its factors would be none)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.up(x)) @ self.head.weight.t()


def test_the_first_step_check_sees_a_layer_never_called_and_tolerates_bf16():
    model = CalledAsAFunction()
    factors = Factors(model, FlatExchange(world_size=1), SufficientFactors.ON, rows_hint=4)
    model(torch.randn(5, 6)).square().sum().backward()
    with pytest.raises(ConfigError, match=r"\['head.weight'\] is used outside its nn.Linear"):
        factors.sum_gradients()
    factors.close()
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    checked = Factors(wide, FlatExchange(world_size=1), SufficientFactors.ON, rows_hint=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16's rounding is no other use
        out = wide(torch.randn(64, 16))
    out.float().square().sum().backward()
    checked.sum_gradients()
    checked.close()


def test_an_attention_blocks_output_projection_keeps_its_matrix():
    """nn.MultiheadAttention calls its out_proj's weight as a function, never the layer."""
    block = nn.TransformerEncoderLayer(8, 2, 16)
    assert [name for name, _ in factorable(block)] == ["linear1.weight", "linear2.weight"]
