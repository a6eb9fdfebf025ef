"""The worker loop on real gloo process groups over loopback, without Spark.

Two (or three) spawned processes run ``run_worker`` exactly as barrier tasks do;
the barrier's allGather is replaced by a real torch FileStore.
"""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
import torch

from sparkdl.config import SparkDLConfig
from sparkdl.services.ps.protocol import PS_WIRE
from sparkdl.spark.ps_host import host_parameter_server
from sparkdl.wire.framing import frame_bytes
from sparkdl.worker.assembly import Placement, TrainSpec, run_worker
from tests.reference import (
    make_shards,
    make_tiny_net,
    max_abs_diff,
    reference_sgd,
    shard_plan,
    shard_to_batch,
)
from tests.workers import keep_built_strategies, worker_context

LR, MOMENTUM = 0.1, 0.9


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _plain_sgd(params):
    return torch.optim.SGD(params, lr=LR)


def file_all_gather(path: str, rank: int, world: int):
    import torch.distributed as dist

    store = dist.FileStore(path, world)
    store.set_timeout(timedelta(seconds=30))

    rounds = iter(range(1_000))

    def all_gather(message: str) -> list[str]:
        round_ = next(rounds)
        store.set(f"msg{round_}-{rank}", message)
        return [store.get(f"msg{round_}-{r}").decode() for r in range(world)]

    return all_gather


def _worker(rank, world, shards, spec, store_path, out, peers=()):
    x, y = shards[rank]
    batches = [shard_to_batch(x, y)] if len(y) else []
    train_on(rank, world, batches, spec, store_path, out, peers)


def train_on(rank, world, batches, spec, store_path, out, peers=()):
    """``run_worker`` on ``batches`` as rank ``rank`` of ``world`` over loopback gloo; its
    result, or its error, put on ``out``."""
    import os

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        placement = Placement(rank, world, "127.0.0.1", peers=peers)
        result = run_worker(spec, iter(batches), placement, file_all_gather(store_path, rank, world))
        out.put((rank, result.state, result.history, None))
    except Exception as exc:  # reported to the test process
        out.put((rank, b"", [], f"{type(exc).__name__}: {exc}"))


class _OwnWeights:
    """The results queue of a worker that sends back its own final weights, every rank
    (``run_worker`` returns rank 0's only)."""

    def __init__(self, out, built):
        self._out = out
        self._built = built  # the strategy the worker assembled

    def put(self, item):
        rank, _, history, error = item
        buffer = io.BytesIO()
        if self._built:
            torch.save(self._built[0].ctx.module.state_dict(), buffer)
        self._out.put((rank, buffer.getvalue(), history, error))


def _worker_sending_its_weights(rank, world, shards, spec, store_path, out, peers=()):
    built = keep_built_strategies()
    _worker(rank, world, shards, spec, store_path, _OwnWeights(out, built), peers)


def run_workers(
    shards, tmp_path, optimizer_fn=_sgd, peers=(), model_fn=make_tiny_net, worker=None, **settings
):
    """Train in spawned worker processes; with strategy parameter_server, host it here.
    ``worker`` replaces :func:`_worker` as what each process runs."""
    config = SparkDLConfig().replace(
        num_workers=len(shards), collective_timeout_s=30.0, prefetch_batches=2, **settings
    )
    plan, template = shard_plan(shards)
    spec = TrainSpec(config, model_fn, optimizer_fn, "cross_entropy", plan, template)
    hosted = None
    if config.training.strategy.value == "parameter_server":
        hosted = host_parameter_server(spec, "127.0.0.1")
        spec = hosted.spec
    try:
        state, results = _spawn(shards, tmp_path, spec, peers, worker or _worker)
    finally:
        if hosted is not None:
            hosted.stop()
    if hosted is not None:
        state.update(hosted.parameter_state())
    return state, results


def _spawn(shards, tmp_path, spec, peers=(), worker=_worker):
    tmp_path.mkdir(parents=True, exist_ok=True)
    ctx = worker_context()
    out = ctx.Queue()
    world = len(shards)
    procs = [
        ctx.Process(target=worker, args=(r, world, shards, spec, str(tmp_path / "store"), out, peers))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, state, history, error = out.get(timeout=90)
        results[rank] = (state, history, error)
    for p in procs:
        p.join(30)
    errors = {r: e for r, (_, _, e) in results.items() if e}
    assert not errors, errors
    state = torch.load(io.BytesIO(results[0][0]), weights_only=True)
    return state, results


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sizes", "batch_size", "epochs", "shuffle"),
    [
        ([64, 64], 8, 1, False),  # equal shards: the reference answer
        ([64, 64], 8, 3, True),  # epochs 2+ replay the cache with a seeded shuffle
        ([50, 21], 8, 2, False),  # uneven: the short worker steps on zero-weight fillers
        ([40, 0, 17], 8, 2, True),  # one worker with no rows at all
    ],
)
def test_workers_match_single_process_sgd(tmp_path, sizes, batch_size, epochs, shuffle):
    shards = make_shards(sizes)
    state, results = run_workers(shards, tmp_path, batch_size=batch_size, epochs=epochs, shuffle=shuffle)
    expected = reference_sgd(shards, batch_size, epochs, 0, LR, MOMENTUM, shuffle)
    assert max_abs_diff(state, expected) < 1e-5
    history = results[0][1]
    assert [h["samples"] for h in history] == [sum(sizes)] * epochs
    assert [h["source"] for h in history] == ["spark"] + ["cache"] * (epochs - 1)
    steps = max((s + batch_size - 1) // batch_size for s in sizes)
    assert all(h["steps"] == steps for h in history)
    for rank, size in enumerate(sizes):
        assert [h["local_samples"] for h in results[rank][1]] == [size] * epochs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sizes", "momentum", "shuffle"),
    [
        ([64, 64], 0.0, False),  # the reference: plain SGD, tau = 1, equal partitions
        ([64, 64], MOMENTUM, True),  # momentum buffers are averaged too, so still exact
        ([50, 21], MOMENTUM, False),  # uneven: weights by rows since the last average
        ([40, 0, 17], 0.0, True),  # a worker with no rows neither steps nor drags the average
    ],
)
def test_weight_averaging_every_step_equals_gradient_averaging(tmp_path, sizes, momentum, shuffle):
    shards = make_shards(sizes)
    optimizer_fn = _sgd if momentum else _plain_sgd
    state, results = run_workers(
        shards,
        tmp_path,
        optimizer_fn,
        strategy="weight_averaging",
        sync_every=1,
        batch_size=8,
        epochs=2,
        shuffle=shuffle,
    )
    expected = reference_sgd(shards, 8, 2, 0, LR, momentum, shuffle)
    assert max_abs_diff(state, expected) < 1e-5
    steps = max((s + 7) // 8 for s in sizes)
    assert [h["sync_rounds"] for h in results[0][1]] == [steps, steps]


def _worker_reporting_exchange(rank, world, shards, spec, store_path, out, peers=()):
    """:func:`_worker`, with the result's device record (how the worker exchanged) as its history."""
    import os

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    x, y = shards[rank]
    try:
        placement = Placement(rank, world, "127.0.0.1", peers=peers)
        all_gather = file_all_gather(store_path, rank, world)
        result = run_worker(spec, iter([shard_to_batch(x, y)]), placement, all_gather)
        out.put((rank, result.state, [result.device], None))
    except Exception as exc:
        out.put((rank, b"", [], f"{type(exc).__name__}: {exc}"))


def _with_and_without_shared_memory(shards, tmp_path, **settings):
    """Each run's final weights (rank 0's) and every rank's exchange, with shared_memory on and off."""
    runs = {}
    for on in (True, False):
        state, results = run_workers(
            shards, tmp_path / str(on), worker=_worker_reporting_exchange, shared_memory=on, **settings
        )
        runs[on] = state, [results[r][1][0]["exchange"] for r in range(len(shards))]
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["allreduce", "weight_averaging"])
def test_shared_memory_gives_gloos_weights_bit_for_bit(tmp_path, strategy):
    """On one host the exchange goes through shared memory (the default), with the same sums:
    two workers add a + b in shared memory as gloo's ring does."""
    runs = _with_and_without_shared_memory(
        make_shards([50, 21]), tmp_path, strategy=strategy, sync_every=2, batch_size=8, epochs=2
    )
    assert runs[True][1] == ["shared_memory"] * 2 and runs[False][1] == ["gloo"] * 2
    assert max_abs_diff(runs[True][0], runs[False][0]) == 0.0


@pytest.mark.slow
def test_weight_averaging_sends_a_quarter_of_the_bytes_with_tau_4(tmp_path):
    shards = make_shards([64, 64])
    _, allreduce = run_workers(shards, tmp_path / "a", _plain_sgd, batch_size=8, epochs=1)
    _, averaged = run_workers(
        shards, tmp_path / "b", _plain_sgd, strategy="weight_averaging", sync_every=4, batch_size=8, epochs=1
    )
    full, local = allreduce[0][1][0], averaged[0][1][0]
    assert (full["sync_rounds"], local["sync_rounds"]) == (8, 2)
    assert local["bytes_sent"] / local["samples"] == pytest.approx(full["bytes_sent"] / full["samples"] / 4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sizes", "settings", "momentum"),
    [
        ([64, 64], {"ps_mode": "sync"}, 0.0),  # the reference: plain SGD, equal partitions
        ([50, 21], {"ps_mode": "sync"}, MOMENTUM),  # the optimizer (and its momentum) runs on the server
        ([64, 64], {"ps_mode": "ssp", "staleness": 0}, 0.0),  # SSP with staleness 0 is sync
        ([40, 0, 17], {"ps_mode": "sync", "ps_shards": 3}, 0.0),  # an empty worker pushes zero rows
    ],
)
def test_parameter_server_sync_equals_single_process_sgd(tmp_path, sizes, settings, momentum):
    shards = make_shards(sizes)
    state, results = run_workers(
        shards,
        tmp_path,
        _sgd if momentum else _plain_sgd,
        strategy="parameter_server",
        batch_size=8,
        epochs=2,
        shuffle=True,
        **settings,
    )
    expected = reference_sgd(shards, 8, 2, 0, LR, momentum, True)
    assert max_abs_diff(state, expected) < 1e-5
    steps = max((s + 7) // 8 for s in sizes)
    first = results[0][1][0]
    assert (first["pushes"], first["pulls"]) == (steps, steps + 1)  # + the initial pull
    assert first["bytes_sent"] > 0 and first["bytes_received"] > 0 and first["wait_s"] > 0


@pytest.mark.parametrize("strategy", ["allreduce", "parameter_server"])
def test_accumulating_two_batches_of_4_equals_steps_on_batches_of_8(tmp_path, strategy):
    shards = make_shards([37, 20])  # uneven, and 37 is not a multiple of 8: a short last step
    state, results = run_workers(
        shards, tmp_path, strategy=strategy, batch_size=4, accumulate_steps=2, epochs=2, shuffle=False
    )
    assert max_abs_diff(state, reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, False)) < 1e-5
    assert [h["steps"] for h in results[0][1]] == [5, 5]  # ceil(37 / 8), in the streamed and cached epochs


@pytest.mark.slow
def test_a_slow_worker_with_a_backup_skips_ahead_instead_of_setting_the_pace(tmp_path):
    """Two workers, one backup (each step is made by the first push), rank 1 three times
    slower (the slow drill). Epoch 1 streams in lockstep, so nothing can be skipped; in
    epoch 2 rank 0 runs ahead, rank 1's late pushes are dropped and it skips the steps the
    server has already made, training on fewer of its rows rather than holding rank 0 back."""
    shards = make_shards([96, 96])
    _, results = run_workers(
        shards,
        tmp_path,
        _plain_sgd,
        strategy="parameter_server",
        ps_mode="sync",
        backup_workers=1,
        batch_size=8,
        epochs=2,
        fault_injection="slow:1:0:",
    )
    fast, slow = results[0][1], results[1][1]
    assert fast[1]["skipped_steps"] == 0 and fast[1]["local_samples"] == 96
    assert slow[1]["skipped_steps"] > 0 and slow[1]["dropped_pushes"] > 0
    assert slow[1]["local_samples"] == 96 - 8 * slow[1]["skipped_steps"]
    assert slow[0]["skipped_steps"] == 0  # epoch 1: in lockstep


# --- weight averaging with backup workers -------------------------------------------


def _wide_net():
    # steps of a few milliseconds: a rank three times slower then trails by far more than
    # the scheduler's noise, so which rank finishes a period first is never a coin toss
    nn = torch.nn
    return nn.Sequential(nn.Linear(6, 384), nn.Tanh(), nn.Linear(384, 384), nn.Tanh(), nn.Linear(384, 3))


def reference_local_sgd(shards, batch_size, epochs, tau, lr, seed=0):
    """Plain SGD on every shard in one process, unshuffled, the weights replaced by their
    row-weighted mean every ``tau`` steps and at the end (equal shards: the plain mean)."""
    torch.manual_seed(seed)
    start = _wide_net().state_dict()
    models = []
    for _ in shards:
        model = _wide_net()
        model.load_state_dict(start)
        models.append((model, torch.optim.SGD(model.parameters(), lr=lr)))
    steps = (len(shards[0][1]) + batch_size - 1) // batch_size
    global_step = 0
    for _ in range(epochs):
        for step in range(steps):
            for (model, optimizer), (x, y) in zip(models, shards, strict=True):
                picked = slice(step * batch_size, (step + 1) * batch_size)
                x_step, y_step = torch.from_numpy(x[picked]), torch.from_numpy(y[picked])
                loss = torch.nn.functional.cross_entropy(model(x_step), y_step)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            global_step += 1
            if global_step % tau == 0:
                _average([m for m, _ in models])
    _average([m for m, _ in models])
    return {k: v.detach().clone() for k, v in models[0][0].state_dict().items()}


def _average(models):
    with torch.no_grad():
        for tensors in zip(*(m.parameters() for m in models), strict=True):
            mean = sum(t * (1.0 / len(models)) for t in tensors)
            for t in tensors:
                t.copy_(mean)


def _states(results):
    return {rank: torch.load(io.BytesIO(state), weights_only=True) for rank, (state, _, _) in results.items()}


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["none", "1bit"])  # 1bit: the shared reference holds
def test_weight_averaging_ends_a_period_without_the_slow_worker_when_it_has_a_backup(tmp_path, compression):
    """Two workers, one backup: a period of 4 local steps ends when the first worker has
    finished it. Rank 1 is three times slower (the slow drill); from epoch 2 on it trains
    only the steps it reaches before rank 0 finishes the period, skips the rest, and joins
    every average with the rows it trained. Every rank still ends with the same weights."""
    shards = make_shards([96, 96])
    _, results = run_workers(
        shards,
        tmp_path,
        _plain_sgd,
        model_fn=_wide_net,
        worker=_worker_sending_its_weights,
        strategy="weight_averaging",
        sync_every=4,
        wa_backup_workers=1,
        compression=compression,
        batch_size=8,
        epochs=3,
        fault_injection="slow:1:0:",
    )
    fast, slow = results[0][1], results[1][1]
    assert slow[0]["skipped_steps"] == 0 and slow[0]["local_samples"] == 96  # epoch 1: in lockstep
    assert all(epoch["skipped_steps"] > 0 for epoch in slow[1:]), slow
    # the fast worker ends the periods; it skips only where the machine descheduled it long
    # enough for the slow one to finish a period first (seen once on 2 busy cores)
    assert sum(h["skipped_steps"] for h in fast) <= 1 < sum(h["skipped_steps"] for h in slow), (fast, slow)
    for mine, other in ((fast, slow), (slow, fast)):
        for epoch, others in zip(mine[1:], other[1:], strict=True):
            assert epoch["local_samples"] == 96 - 8 * epoch["skipped_steps"]
            # skipped rows are not counted as trained
            assert epoch["samples"] == epoch["local_samples"] + others["local_samples"]
            assert epoch["sync_rounds"] == 3  # every average still joined: 12 steps, tau 4
    states = _states(results)
    for name, value in states[0].items():
        assert torch.equal(value, states[1][name]), name  # bitwise: one average, decoded by both


@pytest.mark.slow
def test_weight_averaging_without_backups_waits_for_the_slow_worker_and_gives_local_sgds_answer(tmp_path):
    shards = make_shards([96, 96])
    _, results = run_workers(
        shards,
        tmp_path,
        _plain_sgd,
        model_fn=_wide_net,
        worker=_worker_sending_its_weights,
        strategy="weight_averaging",
        sync_every=4,
        batch_size=8,
        epochs=2,
        shuffle=False,
        fault_injection="slow:1:0:",
    )
    assert all(h["skipped_steps"] == 0 and h["local_samples"] == 96 for r in (0, 1) for h in results[r][1])
    states = _states(results)
    assert max_abs_diff(states[0], reference_local_sgd(shards, 8, 2, 4, LR)) < 1e-5
    for name, value in states[0].items():
        assert torch.equal(value, states[1][name]), name


# --- hierarchical aggregation: 4 workers on 2 "hosts" (executors) ----------------------

TWO_HOSTS = ("10.0.0.1:7001", "10.0.0.2:7001", "10.0.0.1:7001", "10.0.0.2:7001")  # ranks 0, 2 | 1, 3
MODEL_BYTES = 4 * sum(p.numel() for p in make_tiny_net().parameters())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("settings", "momentum"),
    [
        ({"strategy": "allreduce"}, MOMENTUM),
        ({"strategy": "weight_averaging", "sync_every": 1}, 0.0),  # momentum: the empty rank has none
        # the two "hosts" are one: the leaders keep their sockets, as on two real hosts
        ({"strategy": "parameter_server", "ps_mode": "sync", "ps_shared_memory_mb": 0.0}, MOMENTUM),
    ],
)
def test_a_hierarchy_gives_the_flat_answer_and_sends_one_model_per_host_across(tmp_path, settings, momentum):
    sizes = [40, 24, 33, 0]  # uneven, and a worker without rows
    shards = make_shards(sizes)
    state, results = run_workers(
        shards,
        tmp_path,
        _sgd if momentum else _plain_sgd,
        peers=TWO_HOSTS,
        hierarchy="executor",
        batch_size=8,
        epochs=2,
        shuffle=True,
        **settings,
    )
    expected = reference_sgd(shards, 8, 2, 0, LR, momentum, True)
    assert max_abs_diff(state, expected) < 1e-5
    steps = 2 * max((s + 7) // 8 for s in sizes)
    across = {rank: sum(h["bytes_across_hosts"] for h in results[rank][1]) for rank in range(4)}
    assert across[2] == across[3] == 0  # members: everything stays on their host (leaders: 0 and 1)
    if settings["strategy"] == "parameter_server":
        # each leader pushes the host's sum to the driver: per step one model in a PUSH frame and a
        # PULL frame (one shard), after the first pull's frame
        pull, push = frame_bytes(PS_WIRE.header.size, 0), frame_bytes(PS_WIRE.header.size, MODEL_BYTES)
        assert across[0] == across[1] == pull + steps * (push + pull)
    else:  # the leaders' ring of two: each sends one model's worth per sync
        assert across[0] == across[1] == steps * MODEL_BYTES


@pytest.mark.slow
def test_a_hierarchys_host_level_goes_through_shared_memory_with_the_same_answer(tmp_path):
    runs = _with_and_without_shared_memory(
        make_shards([40, 24, 33, 17]), tmp_path, peers=TWO_HOSTS, hierarchy="executor", batch_size=8, epochs=2
    )
    assert runs[True][1] == ["shared_memory+gloo"] * 4 and runs[False][1] == ["gloo"] * 4
    assert max_abs_diff(runs[True][0], runs[False][0]) < 1e-6


@pytest.mark.slow
def test_with_a_hierarchy_the_driver_receives_half_the_pushes_of_a_flat_parameter_server(tmp_path):
    shards = make_shards([32, 32, 32, 32])
    common = {"strategy": "parameter_server", "ps_mode": "sync", "batch_size": 8, "epochs": 1}
    flat_state, flat = run_workers(shards, tmp_path / "flat", _plain_sgd, peers=TWO_HOSTS, **common)
    tree_state, tree = run_workers(
        shards, tmp_path / "tree", _plain_sgd, peers=TWO_HOSTS, hierarchy="executor", **common
    )
    assert max_abs_diff(flat_state, tree_state) < 1e-5

    def to_driver(results):
        return sum(results[rank][1][0]["bytes_across_hosts"] for rank in range(4))

    assert to_driver(flat) > 0
    assert to_driver(tree) / to_driver(flat) == pytest.approx(0.5, rel=0.02)


@pytest.mark.slow
def test_an_async_parameter_server_in_a_hierarchy_trains_and_only_leaders_reach_the_driver(tmp_path):
    shards = make_shards([48, 40, 56, 32])
    state, results = run_workers(
        shards,
        tmp_path,
        _plain_sgd,
        peers=TWO_HOSTS,
        hierarchy="executor",
        strategy="parameter_server",
        ps_mode="async",
        push_every=2,
        pull_every=2,
        batch_size=8,
        epochs=2,
    )
    torch.manual_seed(SparkDLConfig().training.seed)  # the server's initial weights
    untrained = make_tiny_net().state_dict()
    assert max_abs_diff(state, untrained) > 1e-3  # they moved
    losses = [h["loss"] for h in results[0][1]]
    assert losses[1] < losses[0]
    for rank in range(4):
        history = results[rank][1]
        assert [h["local_samples"] for h in history] == [len(shards[rank][1])] * 2
        pushes = sum(h["pushes"] for h in history)
        assert (pushes > 0) == (rank in (0, 1)), (rank, pushes)  # members never push themselves
    # 7 steps an epoch, a push every 2 (and the last one at the end): each leader's pushes
    assert sum(h["pushes"] for h in results[0][1]) == sum(h["pushes"] for h in results[1][1]) >= 7
