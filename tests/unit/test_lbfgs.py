"""optimizer = "lbfgs" (Sandblaster L-BFGS): full-batch iterations whose passes and sums run
over every worker's partition, taking PyTorch's own iterates on the union of the data."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparkdl.comm.exchange import FlatExchange
from sparkdl.config import SparkDLConfig
from sparkdl.data.tensors import Batch
from sparkdl.errors import ConfigError, TrainingFailedError
from sparkdl.storage.checkpoint_store import CheckpointStore
from sparkdl.strategies import check_settings
from sparkdl.training.full_batch import FullBatchTrainer, Objective
from sparkdl.training.lbfgs import LbfgsSettings
from sparkdl.training.line_search import cubic_minimum
from sparkdl.training.losses import resolve_loss
from sparkdl.training.precision import Precision
from tests.reference import make_learnable_shards, make_shards, max_abs_diff
from tests.unit.test_outer_optimizer import run_workers_failing
from tests.unit.test_worker_gloo import run_workers

WEIGHT_DECAY = 1e-3


def softmax_regression() -> nn.Module:
    """Multinomial logistic regression on make_shards' 6 features and 3 classes: convex, so
    iterates stay as close as the sums' rounding however many iterations run."""
    torch.manual_seed(0)
    return nn.Linear(6, 3)


def torch_lbfgs(
    x: torch.Tensor,
    y: torch.Tensor,
    model_fn=softmax_regression,
    iterations: int = 12,
    history: int = 4,
    line_search: bool = True,
    weight_decay: float = WEIGHT_DECAY,
) -> tuple[dict[str, torch.Tensor], torch.optim.LBFGS]:
    """PyTorch's L-BFGS in one process on every row at once: one ``step`` of ``iterations``."""
    model = model_fn()
    optimizer = torch.optim.LBFGS(
        model.parameters(),
        lr=1,
        max_iter=iterations,
        history_size=history,
        line_search_fn="strong_wolfe" if line_search else None,
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        penalty = sum(p.square().sum() for p in model.parameters())
        loss = F.cross_entropy(model(x), y) + weight_decay / 2 * penalty
        loss.backward()
        return loss

    optimizer.step(closure)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, optimizer


def union(shards) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.from_numpy(np.concatenate([x for x, _ in shards])),
        torch.from_numpy(np.concatenate([y for _, y in shards])),
    )


class _Rows:
    """One process's rows in batches, every pass the same (the feed's replay)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> None:
        self._batches = [
            Batch({"x": x[i : i + batch_size]}, y[i : i + batch_size]) for i in range(0, len(y), batch_size)
        ]
        self.cached_rows = len(y)
        self.passes: list[int] = []

    def epoch(self, epoch: int):
        self.passes.append(epoch)
        return self._batches, "spark" if epoch == 1 else "cache"


def one_process_lbfgs(x, y, settings: LbfgsSettings, model_fn=softmax_regression, batch_size=16):
    model = model_fn()
    loss_fn, _ = resolve_loss("cross_entropy")
    rows = _Rows(x, y, batch_size)
    exchange = FlatExchange(world_size=1)
    objective = Objective(model, rows, loss_fn, False, exchange, WEIGHT_DECAY, lambda b: None, Precision(), 0)
    history = FullBatchTrainer(settings, objective, exchange).run()
    return model, history, rows


# --- the algorithm, in one process ---------------------------------------------------------


def test_cubic_minimum_finds_a_cubics_minimum_and_keeps_within_bounds():
    # f(t) = (t - 1)^2 is its own cubic: the minimum at 1 from any two points and slopes
    f, g = (lambda t: (t - 1) ** 2), (lambda t: 2 * (t - 1))
    assert cubic_minimum(0.0, f(0.0), g(0.0), 3.0, f(3.0), g(3.0)) == pytest.approx(1.0)
    assert cubic_minimum(3.0, f(3.0), g(3.0), 0.0, f(0.0), g(0.0)) == pytest.approx(1.0)
    assert cubic_minimum(0.0, f(0.0), g(0.0), 3.0, f(3.0), g(3.0), bounds=(2.0, 5.0)) == 2.0
    # no real minimum (the cubic through them has no turning point): the middle of the bounds
    assert cubic_minimum(0.0, 0.0, -1.0, 1.0, -0.5, -1.0) == pytest.approx(0.5)
    # an infinite extrapolation is clipped to its bound, as PyTorch's tensors clip it
    assert cubic_minimum(0.0, 0.0, -1.0, 1.0, -3.0, -5.0, bounds=(1.01, 10.0)) == 10.0


@pytest.mark.parametrize(
    ("model_fn", "iterations", "line_search", "tolerance"),
    [
        (softmax_regression, 20, True, 1e-4),  # past history_size: the oldest pairs are dropped
        (softmax_regression, 10, False, 1e-4),  # a fixed step of lr
        (
            lambda: (torch.manual_seed(0), nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)))[1],
            8,
            True,
            1e-4,
        ),
    ],
)
def test_the_iterates_are_pytorchs_lbfgs_on_the_same_rows(model_fn, iterations, line_search, tolerance):
    # Learnable rows: the objective still changes above float32's rounding for these iterations
    # (past that, both runs wander within rounding of the optimum, each its own way).
    x, y = union(make_learnable_shards([70, 41]))
    settings = LbfgsSettings(lr=1, max_iterations=iterations, history_size=4, line_search=line_search)
    model, history, rows = one_process_lbfgs(x, y, settings, model_fn)
    expected, optimizer = torch_lbfgs(x, y, model_fn, iterations, 4, line_search)
    assert max_abs_diff(model.state_dict(), expected) < tolerance
    state = optimizer.state[next(iter(optimizer.param_groups[0]["params"]))]
    assert [r["iteration"] for r in history] == list(range(1, state["n_iter"] + 1))
    assert history[-1]["passes"] == state["func_evals"] == len(rows.passes)  # one pass per evaluation
    assert rows.passes == list(range(1, len(rows.passes) + 1))  # pass 1 streams, the rest replay
    assert history[-1]["stopped"] in ("max_iterations", "max_evaluations")
    losses = [r["loss"] for r in history]
    if line_search:  # the strong Wolfe search never accepts a higher loss
        assert all(b <= a for a, b in itertools.pairwise(losses))


def test_it_stops_at_its_tolerances_and_its_evaluation_budget():
    x, y = union(make_shards([60]))
    _, history, _ = one_process_lbfgs(x, y, LbfgsSettings(max_iterations=500, tolerance_grad=1e-4))
    assert history[-1]["stopped"] == "tolerance_grad" and history[-1]["grad_max"] <= 1e-4
    assert len(history) < 500
    _, budget, rows = one_process_lbfgs(x, y, LbfgsSettings(max_iterations=500, max_evaluations=7))
    assert budget[-1]["stopped"] == "max_evaluations" and len(rows.passes) == budget[-1]["passes"] <= 7 + 1
    _, at_once, _ = one_process_lbfgs(x, y, LbfgsSettings(tolerance_grad=10.0))  # met at the start point
    assert len(at_once) == 1 and at_once[0]["iteration"] == 0 and at_once[0]["stopped"] == "tolerance_grad"


# --- across workers --------------------------------------------------------------------------

LBFGS = {
    "optimizer": "lbfgs",
    "lr": 1.0,
    "weight_decay": WEIGHT_DECAY,
    "history_size": 4,
    "batch_size": 16,
}


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [[70, 41], [50, 0, 23]])  # uneven; one worker without rows
def test_workers_take_pytorchs_iterates_on_the_union_of_their_rows(tmp_path, sizes):
    shards = make_learnable_shards(sizes)
    state, results = run_workers(
        shards, tmp_path, optimizer_fn=None, model_fn=softmax_regression, max_iterations=15, **LBFGS
    )
    expected, optimizer = torch_lbfgs(*union(shards), iterations=15)
    assert max_abs_diff(state, expected) < 1e-4
    histories = [results[r][1] for r in range(len(sizes))]
    losses = [[e["loss"] for e in h] for h in histories]
    assert all(other == losses[0] for other in losses[1:])  # every rank took the same decisions
    first = histories[0]
    param = next(iter(optimizer.param_groups[0]["params"]))
    assert first[-1]["passes"] == optimizer.state[param]["func_evals"]
    assert all(e["samples"] == sum(sizes) * e["evaluations"] for e in first)
    assert all(e["bytes_sent"] > 0 for e in first)  # every pass's gradient crossed


@pytest.mark.slow
def test_a_failed_worker_resumes_from_the_iteration_checkpointed_with_its_history(tmp_path):
    shards = make_shards([50, 21])
    settings = {**LBFGS, "max_iterations": 10, "model_fn": softmax_regression, "optimizer_fn": None}
    checkpoints = tmp_path / "ckpt"
    resumable = {**settings, "checkpoint_dir": str(checkpoints), "checkpoint_every": 2}
    drill = f"raise:1:5:{tmp_path / 'drill'}"
    failed = run_workers_failing(shards, tmp_path / "failed", fault_injection=drill, **resumable)
    assert "fault drill: rank 1 raised at step 5" in failed
    saved = CheckpointStore(str(checkpoints))
    assert saved.latest() == 4
    held = saved.load(4)["full_batch"]
    assert {"x", "g", "d", "g_prev"} <= set(held["vectors"])
    assert len(held["lbfgs"]["pairs"]) == 3  # iterations 2, 3 and 4 each added a pair
    resumed, results = run_workers(shards, tmp_path / "resumed", **resumable)
    history = results[0][1]
    assert [e["iteration"] for e in history] == list(range(1, 11))  # 1-4 from the checkpoint
    uninterrupted, again = run_workers(shards, tmp_path / "uninterrupted", **settings)
    assert max_abs_diff(resumed, uninterrupted) < 1e-6
    assert [e["loss"] for e in history] == pytest.approx([e["loss"] for e in again[0][1]], abs=1e-7)


@pytest.mark.slow
def test_a_label_the_model_has_no_output_for_stops_every_worker_with_the_rank_that_found_it(tmp_path):
    shards = make_shards([30, 30])
    shards[1][1][7] = 5  # three outputs: class 5 does not exist
    failed = run_workers_failing(
        shards, tmp_path, optimizer_fn=None, model_fn=softmax_regression, max_iterations=3, **LBFGS
    )
    assert "label" in failed and "5" in failed
    assert "another worker rejected its input" in failed  # rank 0 stopped with rank 1


# --- settings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "fix"),
    [
        ({"strategy": "weight_averaging"}, "set strategy = 'allreduce'"),
        ({"precision": "fp16"}, "use 'bf16' or 'fp32'"),
        ({"compression": "fp16"}, "set compression = 'none'"),
        ({"sufficient_factors": "auto"}, "set it to 'off'"),
        ({"accumulate_steps": 2}, "set accumulate_steps = 1"),
        ({"lr_schedule": "warmup_cosine"}, "leave them at their defaults"),
        ({"grad_clip_norm": 1.0}, "set it to 0"),
        ({"early_stopping_patience": 2, "validation_fraction": 0.2}, "set it to 0"),
    ],
)
def test_settings_that_lbfgs_cannot_run_with_are_refused_with_the_fix(settings, fix):
    with pytest.raises(ConfigError, match="optimizer = 'lbfgs'") as refused:
        check_settings(SparkDLConfig().replace(optimizer="lbfgs", **settings))
    assert fix in str(refused.value)
    check_settings(SparkDLConfig().replace(optimizer="lbfgs", precision="bf16"))  # what it runs with


# --- on the parameter server's shards -------------------------------------------------------


def served_lbfgs(shards, tmp_path, model_fn=softmax_regression, **settings):
    """The fit of run_workers with the parameter server hosted here: the final weights, the
    workers' results and the server (its coordinator) for a look afterwards."""
    from sparkdl.spark.ps_host import host_parameter_server
    from sparkdl.worker.assembly import TrainSpec
    from tests.reference import shard_plan
    from tests.unit.test_worker_gloo import _spawn

    config = SparkDLConfig().replace(
        num_workers=len(shards),
        collective_timeout_s=30.0,
        strategy="parameter_server",
        **{**LBFGS, **settings},
    )
    plan, template = shard_plan(shards)
    spec = TrainSpec(config, model_fn, None, "cross_entropy", plan, template)
    hosted = host_parameter_server(spec, "127.0.0.1")
    try:
        state, results = _spawn(shards, tmp_path, hosted.spec)
        hosted.coordinator._thread.join(10)
        state.update(hosted.parameter_state())
    finally:
        hosted.stop()
    return state, results, hosted


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [[70, 41], [50, 0, 23]])
def test_with_the_history_on_the_servers_shards_the_iterates_are_pytorchs(tmp_path, sizes):
    shards = make_learnable_shards(sizes)
    state, results, hosted = served_lbfgs(shards, tmp_path, max_iterations=15, ps_shards=2)
    expected, optimizer = torch_lbfgs(*union(shards), iterations=15)
    assert max_abs_diff(state, expected) < 1e-4
    coordinator = hosted.coordinator
    param = next(iter(optimizer.param_groups[0]["params"]))
    assert [h["iteration"] for h in coordinator.history] == list(range(1, 16))
    assert coordinator.history[-1]["passes"] == optimizer.state[param]["func_evals"]
    assert coordinator.history[-1]["stopped"] == "max_iterations"
    assert all(results[r][1] == [] for r in results)  # the workers only computed passes
    # Sandblaster's layout: each shard holds its own slice of every vector, the history's 4
    # pairs included, and no slice is the whole model
    weight, bias = hosted.model.weight.numel(), hosted.model.bias.numel()
    sizes_held = sorted(len(s) for s in coordinator.vectors.slices("x"))
    assert sizes_held == sorted([weight, bias])
    names = coordinator.vectors.names()
    assert {"x", "g", "d", "g_prev"} <= names
    assert len([n for n in names if n[0] in "sy" and n[1:].isdigit()]) == 2 * 4  # history_size pairs


@pytest.mark.parametrize(
    ("settings", "fix"),
    [
        ({"ps_mode": "async"}, "set ps_mode = 'sync'"),
        ({"backup_workers": 1}, "set it to 0"),
        ({"ps_pull_precision": "bf16"}, "set it to 'fp32'"),
        ({"checkpoint_dir": "/tmp/x"}, "unset checkpoint_dir"),
    ],
)
def test_what_lbfgs_on_the_parameter_server_cannot_run_with_is_refused(settings, fix):
    with pytest.raises(ConfigError, match="optimizer = 'lbfgs'") as refused:
        check_settings(SparkDLConfig().replace(optimizer="lbfgs", strategy="parameter_server", **settings))
    assert fix in str(refused.value)
    check_settings(SparkDLConfig().replace(optimizer="lbfgs", strategy="parameter_server"))


def test_own_loop_refuses_lbfgs_with_the_fix():
    from sparkdl.worker.prepare import check_own_loop_settings

    with pytest.raises(ConfigError, match=r"build torch\.optim\.LBFGS"):
        check_own_loop_settings(SparkDLConfig().replace(optimizer="lbfgs"))


def _worker_of_attempt(rank, world, shards, spec, store_path, out, attempt):
    """test_worker_gloo's worker, as stage attempt ``attempt`` runs it (Spark's task attempt id)."""
    import os

    from sparkdl.worker.assembly import Placement, run_worker
    from tests.reference import shard_to_batch
    from tests.unit.test_worker_gloo import file_all_gather

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    x, y = shards[rank]
    batches = iter([shard_to_batch(x, y)]) if len(y) else iter([])
    try:
        placement = Placement(rank, world, "127.0.0.1", task_attempt=attempt)
        result = run_worker(spec, batches, placement, file_all_gather(store_path, rank, world))
        out.put((rank, result.state, result.history, None))
    except Exception as exc:
        out.put((rank, b"", [], f"{type(exc).__name__}: {exc}"))


@pytest.mark.slow
def test_a_stage_rerun_after_a_failed_worker_continues_from_the_coordinators_point(tmp_path):
    from sparkdl.spark.ps_host import host_parameter_server
    from sparkdl.worker.assembly import TrainSpec
    from tests.reference import shard_plan
    from tests.workers import worker_context

    shards = make_learnable_shards([50, 37])
    config = SparkDLConfig().replace(
        num_workers=2,
        collective_timeout_s=30.0,
        strategy="parameter_server",
        max_iterations=12,
        fault_injection=f"raise:1:6:{tmp_path / 'drill'}",  # rank 1 fails before its 7th pass
        **LBFGS,
    )
    plan, template = shard_plan(shards)
    spec = TrainSpec(config, softmax_regression, None, "cross_entropy", plan, template)
    hosted = host_parameter_server(spec, "127.0.0.1")
    ctx = worker_context()
    try:
        outcomes = []
        for attempt in (0, 1):  # the failed stage, then Spark's re-run of it
            out = ctx.Queue()
            store = tmp_path / f"store{attempt}"
            procs = [
                ctx.Process(
                    target=_worker_of_attempt, args=(r, 2, shards, hosted.spec, str(store), out, attempt)
                )
                for r in range(2)
            ]
            for p in procs:
                p.start()
            outcomes.append(dict(out.get(timeout=90)[::3] for _ in procs))  # rank -> error
            for p in procs:
                p.join(30)
        hosted.coordinator._thread.join(10)
        state = {k: v.clone() for k, v in hosted.parameter_state().items()}
    finally:
        hosted.stop()
    assert "fault drill: rank 1 raised at step 6" in outcomes[0][1]
    assert "stopped" in outcomes[0][0]  # rank 0 stopped with it at its next pull, not at a timeout
    assert outcomes[1] == {0: None, 1: None}
    expected, _ = torch_lbfgs(*union(shards), iterations=12)
    assert max_abs_diff(state, expected) < 1e-4  # no pass was lost or counted twice
    assert [h["iteration"] for h in hosted.coordinator.history] == list(range(1, 13))


def test_a_non_finite_objective_stops_the_run_with_the_fix():
    x, y = union(make_learnable_shards([40]))
    x[3, 2] = float("inf")
    with pytest.raises(TrainingFailedError, match="non-finite objective or gradient at pass 1") as stopped:
        one_process_lbfgs(x, y, LbfgsSettings(max_iterations=3))
    assert "scale the inputs" in str(stopped.value)


class _Counting:
    """ReplicatedVectors that records the most vectors it ever held at once."""

    def __init__(self, inner):
        self._inner = inner
        self.most = 0

    def __getattr__(self, name):
        method = getattr(self._inner, name)

        def call(*args):
            result = method(*args)
            self.most = max(self.most, len(self._inner.tensors))
            return result

        return call


def test_a_long_line_search_holds_two_trial_gradients_at_most():
    from sparkdl.training.full_batch import ReplicatedVectors
    from sparkdl.training.lbfgs import Lbfgs

    x, y = union(make_learnable_shards([60]))
    loss_fn, _ = resolve_loss("cross_entropy")
    model = softmax_regression()
    exchange = FlatExchange(world_size=1)
    objective = Objective(
        model, _Rows(x, y, 64), loss_fn, False, exchange, 0.0, lambda b: None, Precision(), 0
    )
    vectors = _Counting(ReplicatedVectors(objective))
    # lr 1e6: every line search starts far too long and zooms back over many evaluations
    Lbfgs(vectors, LbfgsSettings(lr=1e6, max_iterations=4, max_evaluations=60, history_size=2)).run()
    assert objective.passes > 12  # long searches did happen
    assert vectors.most <= 4 + 2 * 2 + 2  # x, g, d, g_prev, two pairs, two trials


def test_a_run_resumed_from_its_last_iterations_checkpoint_stops_at_once():
    from sparkdl.training.full_batch import Saved

    x, y = union(make_learnable_shards([60]))
    saved = []
    model = softmax_regression()
    loss_fn, _ = resolve_loss("cross_entropy")
    exchange = FlatExchange(world_size=1)
    objective = Objective(
        model, _Rows(x, y, 64), loss_fn, False, exchange, 0.0, lambda b: None, Precision(), 0
    )
    settings = LbfgsSettings(max_iterations=3, max_evaluations=50)
    FullBatchTrainer(settings, objective, exchange, after_iteration=lambda s: saved.append(s.to_dict())).run()
    last = Saved.from_dict(saved[-1], torch.device("cpu"))
    assert last.state.stopped == "max_iterations"  # the checkpoint knows the run is over
    again = Objective(model, _Rows(x, y, 64), loss_fn, False, exchange, 0.0, lambda b: None, Precision(), 0)
    history = FullBatchTrainer(settings, again, exchange, resumed=last).run()
    assert again.passes == 0 and [h["iteration"] for h in history] == [1, 2, 3]


def head_on_a_frozen_layer() -> nn.Module:
    """A head trained on a frozen random projection (fine-tuning a head on frozen features)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    model[0].requires_grad_(False)
    return model


@pytest.mark.slow
def test_a_frozen_layer_stays_put_on_the_shards_as_on_every_worker(tmp_path):
    shards = make_learnable_shards([40, 33])
    settings = {"max_iterations": 8, "weight_decay": 0.05}
    served, _, _ = served_lbfgs(shards, tmp_path / "served", head_on_a_frozen_layer, ps_shards=2, **settings)
    replicated, _ = run_workers(
        shards,
        tmp_path / "replicated",
        optimizer_fn=None,
        model_fn=head_on_a_frozen_layer,
        **{**LBFGS, **settings},
    )
    frozen = head_on_a_frozen_layer()
    assert torch.equal(served["0.weight"], frozen[0].weight) and torch.equal(served["0.bias"], frozen[0].bias)
    assert max_abs_diff(served, replicated) < 1e-4  # the same objective: no decay on what is frozen


def test_a_failed_coordinator_fails_every_attempt_for_good_and_workers_stop_as_one():
    from sparkdl.errors import CoordinatorFailed
    from sparkdl.services.ps.protocol import error_frame, error_of
    from sparkdl.services.ps.store import PsMode, ShardStore

    store = ShardStore([nn.Parameter(torch.zeros(3))], None, PsMode.SYNC, 2, handoff=lambda *a: None)
    store.begin_attempt(0)
    store.fail("the driver's L-BFGS coordinator failed: BadDataError: no rows")
    with pytest.raises(CoordinatorFailed, match="no rows"):
        store.pull(0, 0, timeout_s=1.0)
    store.begin_attempt(1)  # Spark's re-run: still failed, at once
    with pytest.raises(CoordinatorFailed):
        store.push(0, 1, 0, 4, torch.zeros(3))
    try:
        store.pull(1, 0, timeout_s=1.0)
    except CoordinatorFailed as exc:
        seen = error_of(error_frame(exc), rank=1)
    assert isinstance(seen, CoordinatorFailed) and seen.agreed_by_all_ranks  # no re-run of the stage


def test_shards_that_saw_different_passes_stop_the_coordinator():
    import threading

    from sparkdl.errors import CoordinatorFailed
    from sparkdl.services.ps.full_batch import ShardedVectors
    from sparkdl.services.ps.store import PsMode, ShardStore

    vectors = ShardedVectors(weight_decay=0.0)
    stores = [
        ShardStore([nn.Parameter(torch.zeros(2))], None, PsMode.SYNC, 1, handoff=vectors.receive)
        for _ in range(2)
    ]
    vectors.attach(stores)
    for store in stores:
        store.begin_attempt(0)
    failure = []
    evaluation = threading.Thread(target=lambda: failure.append(_raised(lambda: vectors.evaluate(0.0, "g"))))
    evaluation.start()
    stores[0].push(0, 0, 0, 10, torch.ones(2), loss_sum=5.0)
    stores[1].push(0, 0, 0, 11, torch.ones(2), loss_sum=5.0)  # a forged row count on one shard
    evaluation.join(5)
    vectors.stop()
    assert isinstance(failure[0], CoordinatorFailed) and "[10, 11] rows" in str(failure[0])


def _raised(call):
    try:
        call()
    except Exception as exc:
        return exc
    return None


class _Exponential(nn.Module):
    """exp(w.x): a trial step that goes too far overflows the loss to infinity."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 1)

    def forward(self, x):
        return torch.exp(self.linear(x)).squeeze(-1)


def test_a_trial_step_that_overflows_only_shortens_the_step():
    # (torch.optim.LBFGS, the same settings on the same rows, ends with NaN weights here)
    x, _ = union(make_learnable_shards([60]))
    y = torch.exp(x[:, 0] * 0.5)  # a target the model can reach: weight [0.5, 0, ...], bias 0
    settings = LbfgsSettings(lr=80.0, max_iterations=12, max_evaluations=60)
    model = _Exponential()
    loss_fn, _ = resolve_loss("mse")
    exchange = FlatExchange(world_size=1)
    objective = Objective(
        model, _Rows(x, y, 64), loss_fn, False, exchange, 0.0, lambda b: None, Precision(), 0
    )
    seen: list[float] = []
    history = FullBatchTrainer(settings, _Watched(objective, seen), exchange).run()
    assert any(not math.isfinite(loss) for loss in seen)  # a trial overflowed...
    assert all(math.isfinite(h["loss"]) for h in history)  # ...no iteration stood on one...
    assert (
        history[-1]["loss"] < 1e-3 and abs(float(model.linear.weight[0, 0]) - 0.5) < 0.02
    )  # ...and it got there


class _Watched:
    """An objective whose every loss is recorded."""

    def __init__(self, objective, seen):
        self._objective = objective
        self._seen = seen

    def __getattr__(self, name):
        return getattr(self._objective, name)

    def __call__(self):
        loss, gradient = self._objective()
        self._seen.append(loss)
        return loss, gradient
