"""Each strategy alone on a one-process gloo group, against plain PyTorch."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from sparkdl.comm.exchange import FlatExchange
from sparkdl.config import SparkDLConfig
from sparkdl.errors import ConfigError, TrainingFailedError
from sparkdl.strategies import StepInput, StrategyContext, create_strategy, strategy_class, weight_averaging
from sparkdl.strategies.allreduce import AllReduceStrategy
from sparkdl.strategies.periods import FirstFinishers
from sparkdl.strategies.weight_averaging import WeightAveragingStrategy
from tests.reference import make_tiny_net

X = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
Y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])


def loss_of(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def context(config: SparkDLConfig, module, lr: float = 0.1, ps=None) -> StrategyContext:
    """As the worker assembles it: the strategy prepares the module before the optimizer."""
    module = strategy_class(config.training.strategy).prepare_module(module, config, torch.device("cpu"))
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    return StrategyContext(config, 0, 1, torch.device("cpu"), module, optimizer, None, ps)


def step_input(step: int, batch=(X, Y), rows: int | None = None) -> StepInput:
    n = len(batch[0]) if batch is not None else 0
    rows = n if rows is None else rows
    batches = (batch,) if batch is not None else ()
    return StepInput(step, 1, batches, rows, max(rows, 1), loss_of, lambda: (X[:2], Y[:2]))


def reference_after(steps: int, model, lr: float = 0.1):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        loss_of(model, (X, Y)).backward()
        optimizer.step()
    return model.state_dict()


def assert_same_weights(module, expected):
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("strategy", ["allreduce", "weight_averaging", "fsdp"])
def test_one_worker_takes_exactly_plain_sgd_steps(gloo_group, strategy):
    module = make_tiny_net()
    expected = reference_after(3, module)
    config = SparkDLConfig().replace(num_workers=1, strategy=strategy, sync_every=2)
    built = create_strategy(context(config, module))
    try:
        losses = [float(built.train_step(step_input(s)).loss.detach()) for s in range(3)]
        built.finish()
        final = built.full_state_dict()  # the gathered state, for fsdp
    finally:
        built.close()
    for name, value in final.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)
    assert losses[0] > 0
    stats = built.end_epoch()
    # weight averaging, tau 2: after step 2, then finish
    assert stats.sync_rounds == (2 if strategy == "weight_averaging" else 3)


def test_all_reduce_runs_a_worker_without_rows_on_a_zero_weight_filler(gloo_group):
    module = make_tiny_net()
    before = copy.deepcopy(module.state_dict())
    built = create_strategy(context(SparkDLConfig().replace(num_workers=1), module))
    try:
        assert isinstance(built, AllReduceStrategy) and built.model is module  # one worker: no DDP
        outcome = built.train_step(StepInput(0, 1, (), 0, 8, loss_of, lambda: (X[:2], Y[:2])))
    finally:
        built.close()
    assert float(outcome.loss.detach()) > 0  # the filler's forward ran, so the all-reduce was joined
    assert_same_weights(module, before)  # and nothing of it reached the weights
    assert built.model is module  # close let go of DDP


def test_weight_averaging_checkpoints_only_right_after_an_average(gloo_group):
    config = SparkDLConfig().replace(num_workers=1, strategy="weight_averaging", sync_every=4)
    built = create_strategy(context(config, make_tiny_net()))
    assert isinstance(built, WeightAveragingStrategy) and built.checkpoint_multiple == 4
    assert (
        create_strategy(context(SparkDLConfig().replace(num_workers=1), make_tiny_net())).checkpoint_multiple
        == 1
    )


def test_weight_averaging_defers_a_non_finite_step_to_the_next_average(gloo_group):
    config = SparkDLConfig().replace(num_workers=1, strategy="weight_averaging", sync_every=3)
    module = make_tiny_net()
    built = create_strategy(context(config, module))
    poisoned = (torch.full_like(X, float("nan")), Y)
    before = copy.deepcopy(module.state_dict())
    built.train_step(step_input(0, poisoned))  # skipped; the error waits for the average
    built.train_step(step_input(1))  # stopping: skipped too
    assert_same_weights(module, before)
    with pytest.raises(
        TrainingFailedError, match="non-finite loss or gradient at rank 0, epoch 1, step 0"
    ) as raised:
        built.train_step(step_input(2))  # step 3 of tau 3: the average raises on every rank
    assert raised.value.agreed_by_all_ranks


class _RecordingStore:
    """A process group's store that remembers every ``add`` it was asked."""

    def __init__(self):
        self.shared = dist.HashStore()  # what the other ranks reach
        self.adds: list[tuple[str, int]] = []

    def add(self, key, amount):
        self.adds.append((key, amount))
        return self.shared.add(key, amount)

    def delete_key(self, key):
        return self.shared.delete_key(key)


def test_weight_averaging_with_a_backup_trains_none_of_a_period_the_others_finished(gloo_group, monkeypatch):
    """Rank 0 of two with one backup (rank 1 plays its part through the store): a period of
    2 steps ends once one worker finished it; rank 0 then skips the rest of it, yet joins
    its average. Only from epoch 2, and only a worker with rows at every step counts."""
    # the pretend second rank cannot answer the build's check of the frozen weights (a
    # gather over a group of one); the model has none, so the check has nothing to say
    monkeypatch.setattr(weight_averaging, "agree_on_frozen", lambda *args: False)
    config = SparkDLConfig().replace(
        num_workers=2, strategy="weight_averaging", sync_every=2, wa_backup_workers=1
    )
    module = make_tiny_net()
    store = _RecordingStore()
    # rank 1 is played through the store: the process group holds rank 0 alone, so its sums
    # are rank 0's own values
    two = FlatExchange(world_size=2)
    ctx = dataclasses.replace(context(config, module), world_size=2, attempt=3, store=store, exchange=two)
    built = create_strategy(ctx)
    other = FirstFinishers(store.shared, 3, quorum=1)  # rank 1, as it counts

    def step(index, epoch, batch=(X, Y)):
        rows = len(batch[0]) if batch else 0
        batches = (batch,) if batch else ()
        outcome = built.train_step(
            StepInput(index, epoch, batches, rows, 16, loss_of, lambda: (X[:2], Y[:2]))
        )
        return float(outcome.loss.detach()), not outcome.trained

    (loss_0, skipped_0), (loss_1, skipped_1) = step(0, 1), step(1, 1)  # period 0, epoch 1
    assert loss_0 > 0 and loss_1 > 0 and not skipped_0 and not skipped_1
    assert not any(amount == 0 for _, amount in store.adds)  # epoch 1: nobody asks the store
    other.finished(1)  # rank 1 finished period 1 (epoch 2) before rank 0 began it
    before = copy.deepcopy(module.state_dict())
    assert [step(2, 2), step(3, 2)] == [(0.0, True), (0.0, True)]
    assert_same_weights(module, before)  # nothing trained (its own average leaves them as they are)
    assert step(4, 2)[1] is False and step(5, 2)[1] is False  # period 2: nobody finished before it
    assert step(6, 2)[1] is False and step(7, 2, batch=None)[1] is False  # period 3: rows ran out
    stats = built.end_epoch()
    assert (stats.skipped_steps, stats.sync_rounds) == (2, 4)  # every average joined
    finishes = [key.rsplit("-", 1)[1] for key, amount in store.adds if amount == 1]
    assert finishes == ["0", "2"]  # not period 1 (cut short), nor 3 (its rows ran out)
    assert {key.split("/")[2] for key, _ in store.adds} == {"attempt-3"}
    assert not other.over(1)  # rank 0 dropped each period's counter after its average


def test_weight_averaging_refuses_backups_without_a_store(gloo_group):
    config = SparkDLConfig().replace(
        num_workers=2, strategy="weight_averaging", sync_every=2, wa_backup_workers=1
    )
    ctx = dataclasses.replace(
        context(config, make_tiny_net()), world_size=2, exchange=FlatExchange(world_size=2)
    )
    with pytest.raises(ConfigError, match="wa_backup_workers = 1 needs the process group's store"):
        create_strategy(ctx)


def test_all_reduce_stops_at_once_on_a_non_finite_average(gloo_group):
    built = create_strategy(context(SparkDLConfig().replace(num_workers=1), make_tiny_net()))
    try:
        with pytest.raises(TrainingFailedError) as raised:
            built.train_step(step_input(0, (torch.full_like(X, float("inf")), Y)))
    finally:
        built.close()
    assert raised.value.agreed_by_all_ranks  # every rank holds the same non-finite average


def test_the_parameter_server_strategy_pushes_gradients_and_pulls_the_servers_step(gloo_group):
    from sparkdl.spark.ps_host import host_parameter_server
    from sparkdl.worker.assembly import TrainSpec
    from tests.reference import shard_plan

    config = SparkDLConfig().replace(num_workers=1, strategy="parameter_server", ps_shards=2)
    plan, template = shard_plan([(X.numpy(), Y.numpy())])
    spec = TrainSpec(config, make_tiny_net, _sgd, "cross_entropy", plan, template)
    hosted = host_parameter_server(spec, "127.0.0.1")
    try:
        module = make_tiny_net()
        built = create_strategy(context(config, module, ps=hosted.spec.ps))
        try:
            expected = reference_after(2, module)  # from the weights it pulled from the server
            for s in range(2):
                built.train_step(step_input(s))
            stats = built.end_epoch()
        finally:
            built.close()
        assert (stats.pushes, stats.pulls) == (2, 3)  # + the initial pull
        assert_same_weights(module, expected)  # the server's optimizer stepped, the worker's did not
        assert not module.state_dict().keys() - hosted.parameter_state().keys()
    finally:
        hosted.stop()


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)
