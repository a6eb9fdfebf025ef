"""Streaming DiLoCo (``fragments > 1``): the fragments' cut and schedule, and on real gloo
process groups the weights of a plain single-process simulation of the same rounds, with and
without a delay, a mix and the outer optimizer; resume from a checkpoint; the refusals."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F

from sparkdl.config import SparkDLConfig
from sparkdl.data.inputs import LabelKind, plan_data
from sparkdl.errors import ConfigError
from sparkdl.storage.checkpoint_store import CheckpointStore
from sparkdl.strategies.outer import CHECKPOINT_KEY, REFERENCE_KEY
from sparkdl.strategies.streaming import cut_into_fragments, send_offset
from tests.reference import make_shards, make_tiny_net, max_abs_diff, shard_to_batch
from tests.unit.test_outer_optimizer import run_workers_failing
from tests.unit.test_worker_gloo import run_workers, train_on

LR = 0.1


def _plain_sgd(params):
    return torch.optim.SGD(params, lr=LR)


def test_fragments_are_consecutive_runs_of_about_equal_bytes_and_never_empty():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([48, 8, 24, 3, 100, 1, 1])]
    runs = cut_into_fragments(named, 3)
    assert [[name for name, _ in run] for run in runs] == [["t0", "t1", "t2"], ["t3", "t4"], ["t5", "t6"]]
    assert [name for run in runs for name, _ in run] == [name for name, _ in named]  # the model's order
    assert [len(run) for run in cut_into_fragments(named[:2], 5)] == [1, 1]  # one tensor each at most
    even = cut_into_fragments([(str(i), torch.zeros(10)) for i in range(8)], 4)
    assert [len(run) for run in even] == [2, 2, 2, 2]
    assert [send_offset(p, 4, 100) for p in range(4)] == [0, 25, 50, 75]  # one fragment at a time


def _send_steps(steps: int, tau: int, fragments: int) -> list[list[int]]:
    return [
        [s for s in range(steps) if (s + 1 + send_offset(p, fragments, tau)) % tau == 0]
        for p in range(fragments)
    ]


def test_each_fragment_is_sent_once_every_sync_every_steps_at_its_own_offset():
    assert _send_steps(12, 4, 2) == [[3, 7, 11], [1, 5, 9]]
    assert _send_steps(12, 4, 4) == [[3, 7, 11], [2, 6, 10], [1, 5, 9], [0, 4, 8]]


def reference_streaming(
    shards, batch_size, epochs, tau, fragments, delay, mix, outer_lr=1.0, outer_momentum=0.0, seed=0
) -> dict[str, torch.Tensor]:
    """One process, one model per worker, plain PyTorch: local SGD steps; every fragment's
    weighted average at its send steps, ``torch.optim.SGD(nesterov=True)`` on its global copy
    ``delay`` steps later, merged with ``mix`` of each worker's own; at each epoch's end the
    fragments in flight applied, then the whole model averaged (each fragment weighted by the
    rows since its last round), the global copies left where their rounds put them (the next
    round's change counts from there)."""
    torch.manual_seed(seed)
    base = make_tiny_net()
    workers = [copy.deepcopy(base) for _ in shards]
    inner = [torch.optim.SGD(w.parameters(), lr=LR) for w in workers]
    groups = [[n for n, _ in run] for run in cut_into_fragments(list(base.named_parameters()), fragments)]
    global_ = {n: p.detach().clone() for n, p in base.named_parameters()}
    outer = {}
    for index, group in enumerate(groups):
        tensors = [global_[n].requires_grad_() for n in group]
        nesterov = outer_momentum > 0
        outer[index] = torch.optim.SGD(tensors, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
    rows_since = [[0] * len(shards) for _ in groups]
    in_flight: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}

    def params(w):
        return dict(w.named_parameters())

    def apply(index):
        _, average = in_flight.pop(index)
        for n in groups[index]:
            global_[n].grad = (global_[n] - average[n]).detach()
        outer[index].step()
        with torch.no_grad():
            for w in workers:
                for n in groups[index]:
                    params(w)[n].copy_(mix * params(w)[n] + (1 - mix) * global_[n] if mix else global_[n])

    step = 0
    for _ in range(epochs):
        steps = max((len(y) + batch_size - 1) // batch_size for _, y in shards)
        for local in range(steps):
            for rank, ((x, y), w) in enumerate(zip(shards, workers, strict=True)):
                xs, ys = (
                    x[local * batch_size : (local + 1) * batch_size],
                    y[local * batch_size : (local + 1) * batch_size],
                )
                rows = len(ys)
                if rows:
                    loss = F.cross_entropy(w(torch.from_numpy(xs)), torch.from_numpy(ys))
                    inner[rank].zero_grad()
                    loss.backward()
                    inner[rank].step()
                for index in range(len(groups)):
                    rows_since[index][rank] += rows
            for index, group in enumerate(groups):
                if (step + 1 + send_offset(index, len(groups), tau)) % tau:
                    continue
                total = sum(rows_since[index])
                weights = [r / total for r in rows_since[index]] if total else []
                rows_since[index] = [0] * len(shards)
                if total:
                    with torch.no_grad():
                        average = {
                            n: sum(a * params(w)[n].detach() for a, w in zip(weights, workers, strict=True))
                            for n in group
                        }
                    in_flight[index] = (step + delay, average)
            for index in [i for i, (due, _) in in_flight.items() if due == step]:
                apply(index)
            step += 1
        for index in list(in_flight):
            apply(index)
        with torch.no_grad():  # each fragment weighted by the rows since its last round
            for index, group in enumerate(groups):
                total = sum(rows_since[index])
                weights = [r / total for r in rows_since[index]] if total else [1 / len(shards)] * len(shards)
                for n in group:
                    mean = sum(a * params(w)[n].detach() for a, w in zip(weights, workers, strict=True))
                    for w in workers:
                        params(w)[n].copy_(mean)
        rows_since = [[0] * len(shards) for _ in groups]
    return {k: v.detach().clone() for k, v in workers[0].state_dict().items()}


STREAMING = {
    "strategy": "weight_averaging",
    "sync_every": 4,
    "batch_size": 8,
    "shuffle": False,
    "seed": 0,
    "average_optimizer_state": False,
}


@pytest.fixture(scope="module")
def whole_rounds(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The same run in whole-model rounds (``fragments = 1``)."""
    shards = make_shards([50, 21])
    state, _ = run_workers(
        shards, tmp_path_factory.mktemp("whole"), optimizer_fn=_plain_sgd, epochs=2, **STREAMING
    )
    return state


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fragments", "delay", "mix", "outer"),
    [
        (2, 0, 0.0, {}),  # DiLoCo's round per fragment, plain averaging
        (2, 2, 0.5, {"outer_optimizer": "nesterov"}),  # overlapped two steps, half the own weights kept
        # gloo's sockets: each fragment's sum an asynchronous all-reduce under the next steps
        (2, 2, 0.5, {"outer_optimizer": "nesterov", "shared_memory": False}),
        (4, 1, 0.0, {"outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.5}),
    ],
)
def test_streaming_gives_the_weights_of_a_plain_simulation_of_its_rounds(
    tmp_path, whole_rounds, fragments, delay, mix, outer
):
    shards = make_shards([50, 21])
    settings = {**STREAMING, **outer, "fragments": fragments, "fragment_delay": delay, "fragment_mix": mix}
    state, results = run_workers(shards, tmp_path, optimizer_fn=_plain_sgd, epochs=2, **settings)
    nesterov = outer.get("outer_optimizer") == "nesterov"
    lr, momentum = (outer.get("outer_lr", 0.7), outer.get("outer_momentum", 0.9)) if nesterov else (1.0, 0.0)
    expected = reference_streaming(shards, 8, 2, 4, fragments, delay, mix, lr, momentum)
    assert max_abs_diff(state, expected) < 1e-5
    assert max_abs_diff(state, whole_rounds) > 1e-4  # the fragments took another path than whole-model rounds
    # epoch 1's 7 steps: each fragment at its own steps, then the whole model at the epoch's end
    # (two workers: a sum sends its payload once, in the ring or into shared memory)
    runs = cut_into_fragments(list(make_tiny_net().named_parameters()), fragments)
    sends = _send_steps(7, 4, len(runs))
    fragment_bytes = [sum(t.numel() * 4 for _, t in run) for run in runs]
    model_bytes = sum(fragment_bytes)
    expected_bytes = sum(len(steps) * b for steps, b in zip(sends, fragment_bytes, strict=True)) + model_bytes
    assert results[0][1][0]["bytes_sent"] == expected_bytes


def _held_out(x, y) -> pa.RecordBatch:
    """The shard's rows with every fifth one held out to validate."""
    batch = shard_to_batch(x, y)
    return batch.append_column("held_out", pa.array(np.arange(len(y)) % 5 == 4))


def _validating_worker(rank, world, shards, spec, store_path, out, peers=()):
    """``run_worker`` on the shard with a validation column: every epoch ends in a validation,
    which every strategy makes one model for first."""
    batch = _held_out(*shards[rank])
    plan = plan_data(
        batch.schema,
        feature_cols=("features",),
        label_col="label",
        label_kind=LabelKind.CLASS_INDEX,
        validation_col="held_out",
    )
    train_on(rank, world, [batch], dataclasses.replace(spec, plan=plan), store_path, out, peers)


def _one_tensor_model() -> torch.nn.Module:
    """A model of one parameter tensor: however many fragments are asked for, there is one."""
    torch.manual_seed(3)
    return torch.nn.Linear(6, 3, bias=False)


@pytest.mark.slow
def test_one_fragment_with_epoch_end_averages_is_plain_diloco_with_its_rounds_cut_short(tmp_path):
    """Epochs of 7 steps, rounds of 4: streaming averages the whole model at each epoch's end,
    as plain DiLoCo does for a validation; either way what was trained before that average
    must reach the model through the outer optimizer at the round's end, so one fragment
    (the one tensor's) is plain DiLoCo's rounds, step for step."""
    shards = make_shards([50, 21])
    settings = {
        **STREAMING,
        "outer_optimizer": "nesterov",
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "epochs": 3,
    }
    common = {"model_fn": _one_tensor_model, "worker": _validating_worker}
    plain, results = run_workers(shards, tmp_path / "plain", _plain_sgd, **common, **settings)
    streamed, _ = run_workers(shards, tmp_path / "streamed", _plain_sgd, **common, fragments=2, **settings)
    history = results[0][1]
    assert [record["steps"] for record in history] == [5, 5, 5]  # rounds cut short after steps 5 and 10
    assert "val_loss" in history[0]
    assert max_abs_diff(streamed, plain) == 0.0  # the same rounds, the same sums, bit for bit


@pytest.mark.slow
def test_streaming_resumes_from_a_checkpoint_with_its_momentum(tmp_path):
    shards = make_shards([50, 21])
    settings = {**STREAMING, "epochs": 2, "fragments": 2, "fragment_delay": 1, "outer_optimizer": "nesterov"}
    checkpoints = tmp_path / "ckpt"
    resumable = {**settings, "checkpoint_dir": str(checkpoints), "checkpoint_every": 4}
    failed = run_workers_failing(
        shards,
        tmp_path / "failed",
        optimizer_fn=_plain_sgd,
        fault_injection=f"raise:1:9:{tmp_path / 'drill'}",
        **resumable,
    )
    assert "fault drill: rank 1 raised at step 9" in failed
    saved = CheckpointStore(str(checkpoints))
    assert saved.latest() == 8
    state = saved.load(8)
    assert len(state["strategy"][CHECKPOINT_KEY]) == 4  # every parameter's momentum, both fragments
    assert len(state["strategy"][REFERENCE_KEY]) == 4  # and the weights their rounds started from
    resumed, results = run_workers(shards, tmp_path / "resumed", optimizer_fn=_plain_sgd, **resumable)
    assert results[0][1][-1]["resumed_from_step"] == 8
    # the same run without the fault: its checkpoint steps average the whole model too
    again = {**resumable, "checkpoint_dir": str(tmp_path / "again")}
    uninterrupted, _ = run_workers(shards, tmp_path / "uninterrupted", optimizer_fn=_plain_sgd, **again)
    assert max_abs_diff(resumed, uninterrupted) < 1e-6
    for key in (CHECKPOINT_KEY, REFERENCE_KEY):  # each left out, to show that it is used
        forgetful = {**resumable, "checkpoint_dir": str(tmp_path / f"forgetful-{key}")}
        strategy_state = {k: v for k, v in state["strategy"].items() if k != key}
        CheckpointStore(forgetful["checkpoint_dir"]).save(8, {**state, "strategy": strategy_state})
        without, _ = run_workers(shards, tmp_path / f"without-{key}", optimizer_fn=_plain_sgd, **forgetful)
        assert max_abs_diff(without, uninterrupted) > 1e-4, key


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"sync_every": 4, "fragments": 5}, "fragments = 5 is more than sync_every = 4"),
        (
            {"sync_every": 4, "fragments": 2, "fragment_delay": 4},
            "fragment_delay = 4 must be below sync_every = 4",
        ),
        ({"fragments": 2, "fragment_mix": 1.0}, "fragment_mix = 1.0 must be below 1"),
        ({"fragments": 0}, "fragments"),
    ],
)
def test_bad_streaming_settings_fail_when_the_config_is_built(settings, message):
    with pytest.raises(ConfigError, match=message):
        SparkDLConfig().replace(strategy="weight_averaging", **settings)


def test_streaming_with_backup_workers_is_refused_with_the_fix():
    from sparkdl.strategies.weight_averaging import WeightAveragingStrategy

    config = SparkDLConfig().replace(
        strategy="weight_averaging", num_workers=3, fragments=2, wa_backup_workers=1
    )
    with pytest.raises(ConfigError, match="fragments = 1 or wa_backup_workers = 0"):
        WeightAveragingStrategy.check_settings(config)
