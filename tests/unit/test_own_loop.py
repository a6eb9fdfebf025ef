"""sparkdl.run's worker side (``run_own_loop``) on real gloo process groups, without Spark:
a user's own loop with ``ctx`` gives the reference answer (single-process SGD on the union
of every step's rows) under all-reduce and weight averaging, on uneven and empty
partitions; bad use fails clearly."""

from __future__ import annotations

import dataclasses
import io

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

from sparkdl.config import SparkDLConfig
from sparkdl.spark.ps_host import serve_parameters
from sparkdl.worker.assembly import Placement
from sparkdl.worker.own_loop import LoopSpec, run_own_loop
from tests.reference import (
    make_shards,
    make_tiny_net,
    max_abs_diff,
    reference_sgd,
    shard_plan,
    shard_to_batch,
)
from tests.unit.test_worker_gloo import file_all_gather
from tests.workers import worker_context

LR, MOMENTUM = 0.1, 0.9


def plain_loop(ctx, lr: float, momentum: float, say_compiled: bool = False):
    """What a user writes: their model, their optimizer, their loss, plain backward and step.
    ``say_compiled``: the state also says whether ctx.prepare compiled the model's forward."""
    torch.manual_seed(0)
    model = make_tiny_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    model, optimizer = ctx.prepare(model, optimizer)
    for epoch in ctx.epochs:
        for batch in ctx.batches(epoch):
            (x,) = batch.inputs.values()
            loss = F.cross_entropy(model(x), batch.label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ctx.report(loss=loss.item())
    inner = getattr(model, "module", model)
    state = inner.state_dict()
    if say_compiled:  # what torch.compile returns carries the function it compiled
        state["compiled"] = torch.tensor(float(hasattr(inner.forward, "_torchdynamo_orig_callable")))
    return state


def _worker(rank, world, shards, spec, store_path, out):
    import os

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    x, y = shards[rank]
    batches = iter([shard_to_batch(x, y)]) if len(y) else iter([])
    try:
        placement = Placement(rank, world, "127.0.0.1")
        result = run_own_loop(spec, batches, placement, file_all_gather(store_path, rank, world))
        buffer = io.BytesIO()
        torch.save(result.returned.state_dict or {}, buffer)
        out.put((rank, buffer.getvalue(), result.history, None))
    except Exception as exc:  # reported to the test process
        out.put((rank, b"", [], exc))


def run_loop(shards, tmp_path, function, *args, served=None, **settings):
    """Every worker of ``function`` in a process of its own; with strategy parameter_server,
    the server hosted here (make_tiny_net's model, SGD with LR and MOMENTUM), its final
    weights put in ``served`` (a dict) when given."""
    config = SparkDLConfig().replace(num_workers=len(shards), collective_timeout_s=30.0, **settings)
    plan, template = shard_plan(shards)
    spec = LoopSpec(config, cloudpickle.dumps((function, args, {})), function.__name__, plan, template)
    if config.training.strategy.value != "parameter_server":
        return _run_workers(shards, tmp_path, spec)
    server, model, endpoint = serve_parameters(config, make_tiny_net, _sgd, "127.0.0.1")
    try:
        results = _run_workers(shards, tmp_path, dataclasses.replace(spec, ps=endpoint))
    finally:
        server.stop()
    if served is not None:
        served.update({name: value.detach().clone() for name, value in model.state_dict().items()})
    return results


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _run_workers(shards, tmp_path, spec):
    tmp_path.mkdir(parents=True, exist_ok=True)
    ctx = worker_context()
    out = ctx.Queue()
    world = len(shards)
    procs = [
        ctx.Process(target=_worker, args=(r, world, shards, spec, str(tmp_path / "store"), out))
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
    return results


def _state(results) -> dict[str, torch.Tensor]:
    errors = {r: e for r, (_, _, e) in results.items() if e}
    assert not errors, errors
    return torch.load(io.BytesIO(results[0][0]), weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sizes", "epochs", "shuffle"),
    [
        ([64, 64], 2, True),  # equal partitions, epoch 2 replayed and shuffled
        ([50, 21], 2, False),  # uneven: the short worker steps on fillers that count zero
        ([40, 0, 17], 2, True),  # a worker without any row
    ],
)
def test_own_loop_with_allreduce_is_single_process_sgd(tmp_path, sizes, epochs, shuffle):
    shards = make_shards(sizes)
    results = run_loop(
        shards, tmp_path, plain_loop, LR, MOMENTUM, batch_size=8, epochs=epochs, shuffle=shuffle
    )
    expected = reference_sgd(shards, 8, epochs, 0, LR, MOMENTUM, shuffle)
    assert max_abs_diff(_state(results), expected) < 1e-5
    history = results[0][1]
    steps = max((s + 7) // 8 for s in sizes)
    assert len(history) == steps * epochs and {h["epoch"] for h in history} == set(range(1, epochs + 1))


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [[64, 64], [50, 21], [40, 0, 17]])
def test_own_loop_with_weight_averaging_every_step_is_single_process_sgd(tmp_path, sizes):
    shards = make_shards(sizes)
    results = run_loop(
        shards,
        tmp_path,
        plain_loop,
        LR,
        0.0,
        strategy="weight_averaging",
        sync_every=1,
        batch_size=8,
        epochs=2,
        shuffle=False,
    )
    expected = reference_sgd(shards, 8, 2, 0, LR, 0.0, False)
    assert max_abs_diff(_state(results), expected) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [[64, 64], [50, 21], [40, 0, 17]])
def test_own_loop_with_the_synchronous_parameter_server_is_single_process_sgd(tmp_path, sizes):
    """The server runs SGD with momentum on the mean over every row of each step; the loop's
    optimizer.step() only hands it the gradients."""
    shards = make_shards(sizes)
    results = run_loop(
        shards, tmp_path, plain_loop, LR, MOMENTUM, strategy="parameter_server", batch_size=8, epochs=2
    )
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, True)
    assert max_abs_diff(_state(results), expected) < 1e-5


def portable_loop(ctx, lr: float, momentum: float, stop_after: int = 0):
    """plain_loop through ctx.state_dict and ctx.load_state_dict, so that it runs unchanged
    under every strategy (fsdp's shards too); with a checkpoint_dir it saves every epoch and
    resumes from the newest, returning after epoch ``stop_after`` (0: the last)."""
    torch.manual_seed(0)
    model = make_tiny_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    model, optimizer = ctx.prepare(model, optimizer)
    checkpoints = bool(ctx.config.reliability.checkpoint_dir)
    saved = ctx.load_checkpoint() if checkpoints else None
    if saved is not None:
        ctx.load_state_dict(model, saved["model"])
        ctx.load_state_dict(optimizer, saved["optimizer"])
    for epoch in ctx.epochs:
        for batch in ctx.batches(epoch):
            if ctx.global_step <= ctx.resumed_from:
                continue  # trained before the checkpoint
            (x,) = batch.inputs.values()
            loss = F.cross_entropy(model(x), batch.label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if checkpoints and ctx.global_step > ctx.resumed_from:
            ctx.save_checkpoint({"model": ctx.state_dict(model), "optimizer": ctx.state_dict(optimizer)})
        if epoch == stop_after:
            break
    return ctx.state_dict(model)


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [[64, 64], [50, 21], [40, 0, 17]])
def test_own_loop_with_fsdp_is_single_process_sgd(tmp_path, sizes):
    """The optimizer built over the whole parameters is pointed at the shards; each rank's
    gradient is weighted by its rows inside FSDP's reduce-scatter; ctx.state_dict gathers."""
    shards = make_shards(sizes)
    results = run_loop(
        shards, tmp_path, portable_loop, LR, MOMENTUM, strategy="fsdp", batch_size=8, epochs=2, shuffle=True
    )
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, True)
    assert max_abs_diff(_state(results), expected) < 1e-5


def two_optimizers(ctx):
    """Two optimizers over one model (its layers split between them) under all-reduce:
    ctx.state_dict and ctx.load_state_dict act on the one named, not the model's first."""
    model = make_tiny_net()
    first = torch.optim.SGD(model.body[0].parameters(), lr=0.1, momentum=0.9)
    second = torch.optim.Adam(model.body[2].parameters(), lr=0.01)
    model, first, second = ctx.prepare(model, first, second)
    for batch in ctx.batches(1):
        (x,) = batch.inputs.values()
        loss = F.cross_entropy(model(x), batch.label)
        first.zero_grad()
        second.zero_grad()
        loss.backward()
        first.step()
        second.step()
    state = ctx.state_dict(second)
    if ctx.rank == 0:
        assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}, state["state"][0]
        ctx.load_state_dict(second, state)
        assert torch.equal(second.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    return {"first": torch.tensor(len(ctx.state_dict(first).get("state", {})))}


def test_state_dict_takes_the_optimizer_it_is_given_of_a_models_several(tmp_path):
    results = run_loop(make_shards([16, 16]), tmp_path, two_optimizers, batch_size=8)
    assert _state(results)["first"].item() == 2  # SGD's momentum buffers: weight and bias of body.0


@pytest.mark.slow
def test_an_fsdp_checkpoint_of_the_own_loop_resumes_under_allreduce(tmp_path):
    """ctx.state_dict's checkpoint is whole: two epochs under fsdp, the third under all-reduce
    from it, give single-process SGD's three epochs (momentum buffers included)."""
    shards = make_shards([50, 21])
    settings = dict(batch_size=8, epochs=3, shuffle=True, checkpoint_dir=str(tmp_path / "ckpt"))
    run_loop(shards, tmp_path / "fsdp", portable_loop, LR, MOMENTUM, 2, strategy="fsdp", **settings)
    resumed = run_loop(shards, tmp_path / "allreduce", portable_loop, LR, MOMENTUM, **settings)
    expected = reference_sgd(shards, 8, 3, 0, LR, MOMENTUM, True)
    assert max_abs_diff(_state(resumed), expected) < 1e-5


def keeps_every_ranks_weights(ctx, folder: str):
    """plain_loop, then each rank's weights saved right after ctx.epochs."""
    import os

    torch.save(plain_loop(ctx, LR, 0.0), os.path.join(folder, f"{ctx.rank}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [dict(ps_mode="async", push_every=1, pull_every=3), dict(ps_mode="ssp", staleness=2)],
    ids=["async", "ssp"],
)
def test_after_the_last_epoch_every_worker_holds_the_servers_final_weights(tmp_path, settings):
    """async and ssp: the loop's last pulls may be stale; after ctx.epochs every worker's last
    push is in and each pulled the server's final weights (what the loop then evaluates or
    returns)."""
    shards = make_shards([64, 40])
    served: dict[str, torch.Tensor] = {}
    results = run_loop(
        shards, tmp_path, keeps_every_ranks_weights, str(tmp_path), strategy="parameter_server",
        batch_size=8, epochs=2, served=served, **settings,
    )  # fmt: skip
    assert not [e for _, _, e in results.values() if e]
    for rank in range(2):
        held = torch.load(tmp_path / f"{rank}.pt", weights_only=True)
        assert max_abs_diff(held, served) == 0.0, rank
    torch.manual_seed(SparkDLConfig().training.seed)  # the server's initial model
    assert max_abs_diff(served, make_tiny_net().state_dict()) > 1e-2  # every push was applied


def loop_then_evaluate(ctx, lr: float, momentum: float):
    """plain_loop, then one more pass over ctx.batches that only evaluates (no step)."""
    state = plain_loop(ctx, lr, momentum)
    for _ in ctx.batches():
        pass
    return state


@pytest.mark.slow
def test_an_evaluation_pass_moves_nothing_on_the_parameter_server(tmp_path):
    shards = make_shards([50, 21])
    results = run_loop(
        shards,
        tmp_path,
        loop_then_evaluate,
        LR,
        MOMENTUM,
        strategy="parameter_server",
        batch_size=8,
        epochs=2,
    )
    assert max_abs_diff(_state(results), reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, True)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sizes", "outer"), [([50, 21], "none"), ([40, 0, 17], "none"), ([50, 21], "nesterov")]
)
def test_own_loop_with_weight_averaging_every_4_steps_is_the_estimators_weight_averaging(
    tmp_path, sizes, outer
):
    """tau > 1 on uneven partitions: a worker whose rows ran out sits the steps out and weighs
    what it trained, as in the Estimator's loop (no filler updates in the average); with
    DiLoCo's outer optimizer too."""
    from tests.unit.test_worker_gloo import run_workers

    shards = make_shards(sizes)
    settings = dict(
        strategy="weight_averaging", sync_every=4, batch_size=8, epochs=2, shuffle=True, outer_optimizer=outer
    )
    results = run_loop(shards, tmp_path / "own", plain_loop, LR, MOMENTUM, **settings)
    estimator, _ = run_workers(shards, tmp_path / "estimator", **settings)
    assert max_abs_diff(_state(results), estimator) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sync_every", "stop_after"),
    [
        (3, 2),  # each epoch (6 steps) ends right after an average
        # epoch 1 ends mid-round: the checkpoint averages plainly, and the round's outer step
        # at step 8 must still measure its change from the round's start (the checkpoint holds it)
        (4, 1),
    ],
)
def test_own_loop_resumes_the_outer_optimizers_momentum_from_ctxs_checkpoint(
    tmp_path, sync_every, stop_after
):
    shards = make_shards([48, 32])  # 6 steps an epoch
    settings = dict(
        strategy="weight_averaging", sync_every=sync_every, batch_size=8, epochs=3, shuffle=True,
        outer_optimizer="nesterov", checkpoint_dir=str(tmp_path / "ckpt"),
    )  # fmt: skip
    run_loop(shards, tmp_path / "first", portable_loop, LR, MOMENTUM, stop_after, **settings)
    resumed = _state(run_loop(shards, tmp_path / "resumed", portable_loop, LR, MOMENTUM, 3, **settings))
    settings["checkpoint_dir"] = str(tmp_path / "other")
    whole = _state(run_loop(shards, tmp_path / "whole", portable_loop, LR, MOMENTUM, 3, **settings))
    assert max_abs_diff(resumed, whole) < 1e-6


def breaks_early(ctx):
    model = make_tiny_net()
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for epoch in ctx.epochs:
        for batch in ctx.batches(epoch):
            (x,) = batch.inputs.values()
            F.cross_entropy(model(x), batch.label).backward()
            optimizer.step()
            break


def orphan_optimizer(ctx):
    return ctx.prepare(make_tiny_net(), torch.optim.SGD(make_tiny_net().parameters(), lr=0.1))


def prepares_twice(ctx):
    model = make_tiny_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.prepare(model, optimizer)
    ctx.prepare(model)


def first_failure_wins(ctx):
    model = make_tiny_net()
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in ctx.batches(1):
        if ctx.rank == 1:
            raise KeyError("label_map")
        (x,) = batch.inputs.values()
        loss = F.cross_entropy(model(x), batch.label)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _driver_error(results):
    """What the driver raises: the first failure, not a peer's stop (spark/driver.py)."""
    errors = [e for _, _, e in results.values() if e is not None]
    assert len(errors) == len(results) and all(e.agreed_by_all_ranks for e in errors)
    # the first to claim the failure; a rank whose claim found rank 0's store gone already
    # (the same refusal raised on every rank at once) reports its own, of the same kind
    firsts = [e for e in errors if type(e).__name__ != "PeerStopped"]
    assert firsts and len({type(e) for e in firsts}) == 1, errors
    return firsts[0]


def keeps_the_original_optimizer(ctx):
    model = make_tiny_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = ctx.prepare(model, optimizer)
    for batch in ctx.batches(1):
        (x,) = batch.inputs.values()
        F.cross_entropy(model(x), batch.label).backward()
        optimizer.step()  # the original: the server would never see these gradients


def fails_after_the_loop_on_rank_0(ctx):
    model = make_tiny_net()
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in ctx.batches(1):
        (x,) = batch.inputs.values()
        F.cross_entropy(model(x), batch.label).backward()
        optimizer.step()
    if ctx.rank == 0:
        raise KeyError("metrics")  # the peers returned: still this error, not a collective mismatch


def stepped_before_prepare(ctx):
    model = make_tiny_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(1, 6)).sum().backward()
    optimizer.step()  # momentum buffers of the whole parameters: fsdp's shards cannot take them
    ctx.prepare(model, optimizer)


def state_of_a_stranger(ctx):
    model = make_tiny_net()
    ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ctx.state_dict(make_tiny_net())


def stray_parameter(ctx):
    model = make_tiny_net()
    temperature = torch.nn.Parameter(torch.ones(()))  # outside the model: nothing would sync it
    ctx.prepare(model, torch.optim.SGD([*model.parameters(), temperature], lr=0.1))


def deferred_sync(ctx):
    model = make_tiny_net()
    model, _ = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model.set_requires_gradient_sync(False)


def test_bad_use_fails_clearly(tmp_path):
    from sparkdl.errors import ConfigError, PeerStopped, TrainFunctionError

    shards = make_shards([16, 16])
    error = _driver_error(run_loop(shards, tmp_path / "orphan", orphan_optimizer))
    assert isinstance(error, ConfigError) and "none of the models" in str(error)
    error = _driver_error(run_loop(shards, tmp_path / "twice", prepares_twice))
    assert isinstance(error, ConfigError) and "called twice on the same TinyNet" in str(error)
    error = _driver_error(run_loop(shards, tmp_path / "break", breaks_early, batch_size=4, epochs=2))
    assert isinstance(error, ConfigError) and "ctx.batches(1) was left before its last batch" in str(error)
    ps = dict(strategy="parameter_server", batch_size=4)
    error = _driver_error(run_loop(shards, tmp_path / "original", keeps_the_original_optimizer, **ps))
    assert isinstance(error, ConfigError) and "use the optimizer ctx.prepare returned" in str(error)
    error = _driver_error(run_loop(shards, tmp_path / "stepped", stepped_before_prepare, strategy="fsdp"))
    assert isinstance(error, ConfigError) and "SGD that holds state already (it stepped" in str(error)
    error = _driver_error(run_loop(shards, tmp_path / "stray", stray_parameter))
    assert isinstance(error, ConfigError) and "holding 1 parameter(s) of no model" in str(error)
    error = _driver_error(run_loop(shards, tmp_path / "deferred", deferred_sync, strategy="fsdp"))
    assert isinstance(error, ConfigError) and "set_requires_gradient_sync" in str(error)
    error = _driver_error(run_loop(shards, tmp_path / "stranger", state_of_a_stranger))
    assert isinstance(error, ConfigError) and "a TinyNet that ctx.prepare never saw" in str(error)
    results = run_loop(shards, tmp_path / "after", fails_after_the_loop_on_rank_0, batch_size=4)
    assert isinstance(results[0][2], TrainFunctionError) and results[0][2].python_type == "KeyError"
    results = run_loop(shards, tmp_path / "first", first_failure_wins, batch_size=4)
    error_1, error_0 = results[1][2], results[0][2]
    assert isinstance(error_1, TrainFunctionError) and error_1.python_type == "KeyError"
    assert "label_map" in error_1.message and "first_failure_wins" in error_1.message
    assert isinstance(error_0, PeerStopped) and "rank 1 failed first" in error_0.message


# --------------------------------------------------------------------------- on a GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def nccl_function(lr: float):
    """A PySpark-style function: NCCL on the GPU torchrun's environment names."""
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    total = torch.ones(1, device=device)
    dist.all_reduce(total)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(3):
        loss = model(torch.ones(8, 4, device=device)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0" and total.item() == dist_world(), total
    return model.state_dict()


def dist_world() -> float:
    import os

    return float(os.environ["WORLD_SIZE"])


@pytest.mark.gpu
@needs_cuda
def test_the_distributors_local_mode_runs_nccl_on_the_gpu_and_returns_a_state_dict():
    from sparkdl.worker.distributor_agent import LaunchSpec, Program, run_local

    program = Program(function=cloudpickle.dumps((nccl_function, (0.1,), {})), name="nccl_function")
    returned = run_local(LaunchSpec(program, 1, use_gpu=True, rendezvous_timeout_s=60), ("0",))
    assert sorted(returned.state_dict) == ["bias", "weight"]
    assert returned.state_dict["weight"].device.type == "cpu"


@pytest.mark.gpu
@needs_cuda
def test_an_own_loop_on_the_gpu_is_single_process_sgd():
    shards = make_shards([64])
    config = SparkDLConfig().replace(
        num_workers=1, batch_size=8, epochs=2, shuffle=False, use_gpu="true", collective_timeout_s=60.0
    )
    plan, template = shard_plan(shards)
    spec = LoopSpec(config, cloudpickle.dumps((plain_loop, (LR, MOMENTUM), {})), "plain_loop", plan, template)
    placement = Placement(0, 1, "127.0.0.1", ("0",))
    result = run_own_loop(spec, iter([shard_to_batch(*shards[0])]), placement, lambda m: [m])
    assert result.device["device"] == "cuda:0"
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, False)
    assert max_abs_diff(result.returned.state_dict, expected) < 1e-4


# --------------------------------------------------------------------------- the distributor's agent


def raises_on(rank: int, delay_s: float = 0.0):
    import os
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")
    if int(os.environ["RANK"]) == rank:
        time.sleep(delay_s)
        raise ValueError(f"bad shard on rank {rank}")
    dist.all_reduce(torch.ones(1))  # the others wait here for the failing rank: an echo follows
    dist.destroy_process_group()


@pytest.mark.parametrize("failing", [0, 1])
def test_local_mode_blames_the_rank_that_failed_first_not_its_echoes(failing):
    from sparkdl.errors import TrainFunctionError
    from sparkdl.worker.distributor_agent import LaunchSpec, Program, run_local

    program = Program(function=cloudpickle.dumps((raises_on, (failing, 0.5), {})), name="raises_on")
    with pytest.raises(TrainFunctionError) as caught:
        run_local(LaunchSpec(program, 2, rendezvous_timeout_s=30), ())
    assert caught.value.rank == failing and caught.value.python_type == "ValueError"
    assert f"bad shard on rank {failing}" in caught.value.message


@pytest.mark.parametrize(
    ("prints_on_driver", "driver_listens", "kept_here"),
    [
        (True, True, False),  # local[N]: the executor's stream is the driver's stderr
        (False, True, True),  # a cluster: the line stays in the executor's log too
        (True, False, True),  # the driver refused the channel: the executor's stream is all it has
    ],
)
def test_each_line_of_a_distributor_child_reaches_the_driver_once(
    capsys, caplog, prints_on_driver, driver_listens, kept_here
):
    """Before: under local[N] every line showed twice on the driver, ``[rank N] line`` from
    the progress channel and bare from the agent's own stdout (which the driver's JVM
    writes on its stderr)."""
    import logging
    import time

    from sparkdl.services.progress.board import ProgressBoard
    from sparkdl.services.progress.channel import ProgressReporter, ProgressServer
    from sparkdl.worker.distributor_agent import _relay_to

    server = ProgressServer(ProgressBoard(2, 1, show=False), "127.0.0.1", b"p" * 32, interval_s=0.05)
    endpoint = server.endpoint()
    if not driver_listens:
        server.stop()
    reporter = ProgressReporter(endpoint, rank=1, attempt=0)
    try:
        sink = _relay_to(reporter, prints_on_driver)
        with caplog.at_level(logging.INFO, logger="sparkdl.worker"):
            sink(1, "stdout", "epoch 1 loss 0.5")
            sink(1, "stderr", "a warning of the child")
            deadline = time.monotonic() + (10 if driver_listens else 0.5)
            while len([r for r in caplog.records if r.name == "sparkdl.worker"]) < 2:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
    finally:
        reporter.close()
        server.stop()
    shown = [r.getMessage() for r in caplog.records if r.name == "sparkdl.worker"]
    relayed = ["[rank 1] epoch 1 loss 0.5", "[rank 1] a warning of the child"]
    assert shown == (relayed if driver_listens else [])
    here = capsys.readouterr()
    if kept_here:
        assert (here.out, here.err) == ("epoch 1 loss 0.5\n", "a warning of the child\n")
    else:
        assert (here.out, here.err) == ("", "")


@pytest.mark.parametrize(
    ("master", "on_driver"),
    [("local[2]", True), ("local", True), ("local-cluster[2,1,1024]", False), ("spark://host:7077", False)],
)
def test_only_a_local_masters_tasks_print_on_the_driver(master, on_driver):
    from types import SimpleNamespace

    from sparkdl.launch.distributor import tasks_print_on_driver

    assert tasks_print_on_driver(SimpleNamespace(sparkContext=SimpleNamespace(master=master))) is on_driver


def returns_early_on_rank_1(ctx):
    model = make_tiny_net()
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for epoch in ctx.epochs:
        if ctx.rank == 1 and epoch == 2:
            return None  # a bug: this rank leaves while the other trains on
        for batch in ctx.batches(epoch):
            (x,) = batch.inputs.values()
            loss = F.cross_entropy(model(x), batch.label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return None


def test_a_rank_that_leaves_the_collectives_early_is_named(tmp_path):
    from sparkdl.errors import CollectiveError

    shards = make_shards([16, 16])
    results = run_loop(shards, tmp_path, returns_early_on_rank_1, batch_size=4, epochs=2)
    assert results[1][2] is None  # rank 1 itself returned without an error
    error = results[0][2]
    assert isinstance(error, CollectiveError) and error.agreed_by_all_ranks
    assert "rank 0 was still training" in error.message and "rank 1 at step 4" in error.message


def test_precision_is_a_setting_of_the_own_loop_through_ctx_autocast():
    from sparkdl.config import SparkDLConfig
    from sparkdl.errors import ConfigError
    from sparkdl.worker.context import TrainContext
    from sparkdl.worker.prepare import check_own_loop_settings

    layer, x = torch.nn.Linear(4, 3), torch.randn(5, 4)
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        config = SparkDLConfig().replace(precision=precision)
        check_own_loop_settings(config)
        ctx = TrainContext(config, 0, 1, torch.device("cpu"), None, None, None)  # type: ignore[arg-type]
        with ctx.autocast():
            assert layer(x).dtype is dtype
        assert layer.weight.dtype is torch.float32  # the weights stay float32
    with pytest.raises(ConfigError, match="GradScaler"):
        check_own_loop_settings(SparkDLConfig().replace(precision="fp16"))


def checkpoints_between_averages(ctx, folder: str, at: int = 2):
    """Weight averaging every 4 steps; at step ``at`` of epoch 1, after its optimizer step,
    every rank asks for the model's state, as a checkpoint does; each rank keeps what it held
    before, what ctx.state_dict gave, and what it holds after."""
    import os

    torch.manual_seed(0)
    model = make_tiny_net()
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    for epoch in ctx.epochs:
        for batch in ctx.batches(epoch):
            (x,) = batch.inputs.values()
            optimizer.zero_grad()
            F.cross_entropy(model(x), batch.label).backward()
            optimizer.step()
            if ctx.global_step == at:
                before = {k: v.detach().clone() for k, v in model.state_dict().items()}
                given = ctx.state_dict(model)
                after = {k: v.detach().clone() for k, v in model.state_dict().items()}
                torch.save(
                    {"before": before, "given": given, "after": after}, os.path.join(folder, f"{ctx.rank}.pt")
                )


@pytest.mark.slow
@pytest.mark.parametrize("at", [2, 5])  # inside a period; the first step after an average
def test_a_checkpoint_between_two_averages_holds_the_averaged_model(tmp_path, at):
    """Before: ctx.state_dict gave rank 0's own drift, and every worker resumed from one
    worker's weights. Now the workers average first: the state is the mean of their
    weights (equal rows: a plain mean), and every worker holds it after; also at the first
    step after an average, whose own update had moved each worker already."""
    shards = make_shards([48, 48])  # 6 steps: averages after steps 4 (and at the end)
    results = run_loop(
        shards, tmp_path, checkpoints_between_averages, str(tmp_path), at, strategy="weight_averaging",
        sync_every=4, batch_size=8, epochs=1, shuffle=False,
    )  # fmt: skip
    assert not [e for _, _, e in results.values() if e]
    kept = [torch.load(tmp_path / f"{rank}.pt", weights_only=True) for rank in range(2)]
    assert max_abs_diff(kept[0]["before"], kept[1]["before"]) > 1e-3  # two steps apart on their own rows
    mean = {k: (kept[0]["before"][k] + kept[1]["before"][k]) / 2 for k in kept[0]["before"]}
    assert max_abs_diff(kept[0]["given"], mean) < 1e-6
    assert max_abs_diff(kept[0]["after"], kept[0]["given"]) == 0.0
    assert max_abs_diff(kept[1]["after"], kept[0]["given"]) == 0.0
    assert kept[1]["given"] == {}  # rank 0's alone, as for every strategy


def compiled_loop(ctx, lr: float, momentum: float):
    """plain_loop, saying whether the model it trained ran a compiled forward."""
    return plain_loop(ctx, lr, momentum, say_compiled=True)


def test_training_compile_compiles_the_own_loops_model_in_place(tmp_path):
    """``training.compile`` in ``sparkdl.run``: ctx.prepare compiles the model as fit does
    (its forward, in place: the same names), and it trains to single-process SGD's weights.
    The ``eager`` backend traces without generating code (inductor takes tens of seconds)."""
    shards = make_shards([32, 32])
    results = run_loop(shards, tmp_path, compiled_loop, LR, MOMENTUM, batch_size=8, epochs=1, shuffle=False,
                       compile=True, compile_backend="eager")  # fmt: skip
    state = _state(results)
    assert state.pop("compiled").item() == 1.0
    assert max_abs_diff(state, reference_sgd(shards, 8, 1, 0, LR, MOMENTUM, False)) < 1e-5
