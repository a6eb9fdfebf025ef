"""The training recipe, without Spark: schedules, accumulation, clipping, precision, weights."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from sparkdl.config import LrSchedule, PsMode, SparkDLConfig
from sparkdl.data.tensors import Batch
from sparkdl.services.ps.store import ShardStore
from sparkdl.strategies import StepInput, StrategyContext, create_strategy
from sparkdl.training.guards import no_label_check
from sparkdl.training.losses import resolve_loss
from sparkdl.training.schedules import CONSTANT_LR, LrPlan, lr_plan, steps_per_epoch_estimate
from tests.reference import make_tiny_net

X = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
Y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])


def rows(x, y):
    return Batch({"features": x}, y)


def loss_of(model, batch):
    return F.cross_entropy(model(batch.inputs["features"]), batch.label)


def test_warm_up_rises_linearly_then_cosine_and_linear_decay_to_zero_at_the_end():
    cosine = LrPlan(LrSchedule.WARMUP_COSINE, warmup_steps=4, total_steps=14)
    assert [cosine.factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine.factor(4) == 1.0 and cosine.factor(9) == pytest.approx(0.5) and cosine.factor(14) == 0.0
    assert cosine.factor(100) == 0.0  # past the estimated end: stays at the end
    linear = LrPlan(LrSchedule.WARMUP_LINEAR, warmup_steps=0, total_steps=10)
    assert [linear.factor(s) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]


def test_a_step_schedule_multiplies_by_gamma_at_each_milestone_epoch():
    config = SparkDLConfig().replace(lr_schedule="step", lr_milestones=[2, 3], lr_gamma=0.1, epochs=3)
    plan = lr_plan(config, steps_per_epoch=5)
    assert plan.milestone_steps == (5, 10)
    assert [plan.factor(s) for s in (0, 4, 5, 9, 10)] == pytest.approx([1, 1, 0.1, 0.1, 0.01])


def test_scale_lr_warms_up_from_lr_to_lr_times_the_workers():
    plan = lr_plan(SparkDLConfig().replace(scale_lr=True, warmup_steps=4, num_workers=4))
    assert [plan.factor(s) for s in range(6)] == [1.75, 2.5, 3.25, 4.0, 4.0, 4.0]
    assert LrPlan().is_constant and not plan.is_constant


def test_the_run_length_estimate_counts_steps_of_every_worker_and_accumulation():
    config = SparkDLConfig().replace(num_workers=2, batch_size=8, accumulate_steps=2)
    assert steps_per_epoch_estimate(100, config) == math.ceil(100 / 32)
    assert steps_per_epoch_estimate(0, config) == 1


def _run(config, steps, batches_of_step, plan=CONSTANT_LR, scheduler_fn=None, model=None):
    module = model or make_tiny_net()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    ctx = StrategyContext(
        config, 0, 1, torch.device("cpu"), module, optimizer, None, None, lr=plan, scheduler_fn=scheduler_fn
    )
    strategy = create_strategy(ctx)
    losses, lrs = [], []
    try:
        for s in range(steps):
            batches = batches_of_step(s)
            n = sum(len(b) for b in batches)
            step = StepInput(s, 1, batches, n, n, loss_of, lambda: rows(X[:2], Y[:2]))
            losses.append(float(strategy.train_step(step).loss))
            lrs.append(optimizer.param_groups[0]["lr"])
    finally:
        strategy.close()
    return module, losses, lrs


def _plain(model, steps, lrs=None, clip=0.0):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        if lrs is not None:
            optimizer.param_groups[0]["lr"] = lrs[s]
        optimizer.zero_grad()
        loss_of(model, rows(X, Y)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model.state_dict()


def _same(module, expected, atol=1e-6):
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=atol)


@pytest.mark.parametrize("strategy", ["allreduce", "weight_averaging"])
def test_two_accumulated_micro_batches_step_as_one_batch_of_their_union(gloo_group, strategy):
    start = make_tiny_net()
    expected = _plain(start, 3)
    config = SparkDLConfig().replace(num_workers=1, strategy=strategy, accumulate_steps=2)
    halves = lambda s: (rows(X[:3], Y[:3]), rows(X[3:], Y[3:]))  # noqa: E731 - uneven micro-batches
    module, losses, _ = _run(config, 3, halves, model=copy.deepcopy(start))
    _same(module, expected)
    assert losses[0] == pytest.approx(float(loss_of(start, rows(X, Y)).detach()), abs=1e-6)


def test_the_schedule_sets_each_steps_lr_and_a_user_scheduler_steps_after_each_step(gloo_group):
    start = make_tiny_net()
    plan = LrPlan(LrSchedule.WARMUP_COSINE, warmup_steps=2, total_steps=4)
    config = SparkDLConfig().replace(num_workers=1)
    module, _, lrs = _run(config, 4, lambda s: (rows(X, Y),), plan=plan, model=copy.deepcopy(start))
    assert lrs == pytest.approx([0.1 * plan.factor(s) for s in range(4)])
    _same(module, _plain(start, 4, lrs))
    halving = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731
    _, _, user = _run(config, 3, lambda s: (rows(X, Y),), scheduler_fn=halving)
    assert user == pytest.approx([0.05, 0.025, 0.0125])


def test_gradients_are_clipped_to_the_global_norm_before_the_step(gloo_group):
    start = make_tiny_net()
    config = SparkDLConfig().replace(num_workers=1, grad_clip_norm=0.05)
    module, _, _ = _run(config, 2, lambda s: (rows(X, Y),), model=copy.deepcopy(start))
    _same(module, _plain(start, 2, clip=0.05))
    assert _plain(start, 2, clip=0.05)["body.0.weight"].ne(_plain(start, 2)["body.0.weight"]).any()


def test_bf16_autocast_trains_close_to_fp32_and_keeps_float32_weights(gloo_group):
    from sparkdl.training.loop import Trainer

    config = SparkDLConfig().replace(num_workers=1, precision="bf16")
    module = make_tiny_net()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    ctx = StrategyContext(config, 0, 1, torch.device("cpu"), module, optimizer)
    strategy = create_strategy(ctx)
    seen = []
    try:
        from sparkdl.training.loop import Schedule

        def recording_loss(output, target, weight):
            seen.append(output.dtype)
            return F.cross_entropy(output, target)

        trainer = Trainer(strategy, recording_loss, False, no_label_check, None, None, Schedule(1, 8), None)
        loss = trainer._loss_of(module, rows(X, Y))
    finally:
        strategy.close()
    assert seen == [torch.bfloat16]  # the forward ran under autocast
    assert float(loss) == pytest.approx(float(loss_of(module, rows(X, Y))), abs=2e-2)
    assert all(p.dtype == torch.float32 for p in module.parameters())


def test_per_row_weights_give_the_mean_of_weight_times_row_loss():
    loss_fn, _ = resolve_loss("cross_entropy")
    out = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    target = torch.tensor([0, 2, 1, 1])
    weight = torch.tensor([1.0, 0.0, 2.0, 0.5])
    expected = (F.cross_entropy(out, target, reduction="none") * weight).mean()
    assert float(loss_fn(out, target, weight)) == pytest.approx(float(expected))
    assert float(loss_fn(out, target, None)) == pytest.approx(float(F.cross_entropy(out, target)))
    mse, _ = resolve_loss("mse")
    assert float(mse(torch.ones(2, 1), torch.zeros(2), torch.tensor([1.0, 3.0]))) == pytest.approx(2.0)


def test_the_parameter_servers_optimizer_follows_the_schedule_by_version():
    param = torch.nn.Parameter(torch.zeros(3))
    plan = LrPlan(LrSchedule.WARMUP_LINEAR, warmup_steps=2, total_steps=4)
    store = ShardStore([param], lambda p: torch.optim.SGD(p, lr=1.0), PsMode.SYNC, 1, lr=plan)
    for clock in range(4):
        store.push(0, 0, clock, 1, torch.ones(3))
    # steps 0..3 take factors 0.5, 1.0, 1.0, 0.5: w = -(0.5 + 1 + 1 + 0.5) * grad
    torch.testing.assert_close(param.detach(), torch.full((3,), -3.0))


def test_early_stopping_waits_patience_epochs_and_keeps_the_best_weights():
    from sparkdl.training.validation import EarlyStopping

    module = torch.nn.Linear(2, 1)
    stopping = EarlyStopping(patience=2, keep_weights=True)
    decisions = []
    for epoch, loss in enumerate([0.9, 0.5, 0.6, 0.4, 0.45, 0.41], start=1):
        with torch.no_grad():
            module.weight.fill_(epoch)
        decisions.append(stopping.update(epoch, loss, module.state_dict))
    assert decisions == [False, False, False, False, False, True]
    assert (stopping.best_epoch, stopping.best_loss) == (4, 0.4)
    assert stopping.restore(module.load_state_dict) and float(module.weight[0, 0]) == 4.0
    assert not EarlyStopping(patience=1, keep_weights=False).restore(module.load_state_dict)


def test_the_validator_sums_every_workers_rows_into_loss_accuracy_and_rmse(gloo_group):
    from sparkdl.data.columns import LabelKind
    from sparkdl.training.validation import Validator

    model = make_tiny_net()
    held = [rows(X[:5], Y[:5]), rows(X[5:], Y[5:])]
    loss_fn, _ = resolve_loss("cross_entropy")
    figures = Validator(
        lambda: held, loss_fn, LabelKind.CLASS_INDEX, False, torch.device("cpu"), None
    ).evaluate(model)
    with torch.no_grad():
        out = model(X)
    assert figures["val_samples"] == 8
    assert figures["val_loss"] == pytest.approx(float(F.cross_entropy(out, Y)), abs=1e-6)
    assert figures["val_accuracy"] == pytest.approx(float((out.argmax(1) == Y).float().mean()))
    assert model.training  # left as it was

    regression = torch.nn.Linear(6, 1)
    target = torch.randn(8)
    mse, _ = resolve_loss("mse")
    real = [Batch({"features": X}, target)]
    figures = Validator(lambda: real, mse, LabelKind.REAL, False, torch.device("cpu"), None).evaluate(
        regression
    )
    with torch.no_grad():
        err = regression(X)[:, 0] - target
    assert figures["val_rmse"] == pytest.approx(float(err.pow(2).mean().sqrt()), abs=1e-6)
    assert figures["val_loss"] == pytest.approx(float(err.pow(2).mean()), abs=1e-6)
    nothing = Validator(lambda: [], mse, LabelKind.REAL, False, torch.device("cpu"), None)
    assert nothing.evaluate(regression) == {}


def test_the_feed_holds_out_the_marked_rows_and_never_trains_on_them():
    import pyarrow as pa

    from sparkdl.data.columns import LabelKind
    from sparkdl.data.feed import FeedOptions, PartitionFeed
    from sparkdl.data.inputs import plan_data

    ids = list(range(20))
    batch = pa.RecordBatch.from_pydict(
        {"x": [float(i) for i in ids], "label": [i % 2 for i in ids], "val": [i % 5 == 0 for i in ids]}
    )
    plan = plan_data(
        batch.schema,
        feature_cols=("x",),
        label_col="label",
        label_kind=LabelKind.CLASS_INDEX,
        validation_col="val",
    )
    options = FeedOptions(batch_size=4, shuffle=True, seed=1, rank=0, prefetch_batches=2)
    feed = PartitionFeed(iter([batch.slice(0, 7), batch.slice(7)]), plan, options)
    try:
        for epoch in (1, 2):
            batches, _ = feed.epoch(epoch)
            trained = sorted(int(v) for b in batches for v in b.inputs["features"][:, 0])
            assert trained == [i for i in ids if i % 5]
        held = [int(v) for b in feed.validation_batches(3) for v in b.inputs["features"][:, 0]]
        assert held == [0, 5, 10, 15] and feed.validation_rows == 4 and feed.cached_rows == 16
    finally:
        feed.close()


def fp16_loss_of(model, batch):
    """What the loop runs with precision = "fp16": forward and loss under autocast."""
    with torch.autocast("cpu", dtype=torch.float16):
        return loss_of(model, batch)


def test_fp16_trains_with_a_gradient_scaler_and_an_overflow_only_skips_the_step(gloo_group):
    config = SparkDLConfig().replace(num_workers=1, precision="fp16")
    start = make_tiny_net()
    module = copy.deepcopy(start)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    strategy = create_strategy(StrategyContext(config, 0, 1, torch.device("cpu"), module, optimizer))
    step = lambda s: StepInput(s, 1, (rows(X, Y),), 8, 8, fp16_loss_of, lambda: rows(X[:2], Y[:2]))  # noqa: E731
    try:
        losses = [float(strategy.train_step(step(s)).loss) for s in range(3)]
        scaler = strategy.ctx.precision.scaler
        assert all(math.isfinite(v) for v in losses) and scaler.get_scale() == 65536.0
        _same(module, _plain(start, 3), atol=1e-2)  # three real steps, within fp16's precision
        # a scale that overflows the fp16 gradients: the scaler skips the step and lowers its
        # scale; the guard is not asked (on_nan_loss = "error" would stop the run)
        before = copy.deepcopy(module.state_dict())
        strategy.ctx.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
        outcome = strategy.train_step(step(3))
        assert math.isfinite(float(outcome.loss)) and strategy.ctx.precision.scaler.get_scale() == 2.0**99
        assert outcome.trained and not outcome.nan_skipped  # the scaler's skip, not the guard's
        _same(module, before, atol=0)
        assert strategy.guard.skipped == 0
    finally:
        strategy.close()
