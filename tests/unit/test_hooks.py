"""The loop's per-step hooks: checkpoints, reseeding, progress."""

from __future__ import annotations

import torch

from sparkdl.config import SparkDLConfig
from sparkdl.storage.checkpoint_store import CheckpointStore
from sparkdl.strategies import StrategyContext, create_strategy
from sparkdl.training.checkpointing import Checkpointer, Position, restore
from sparkdl.training.hooks import CheckpointHook, EpochTally, ProgressHook, ReseedHook
from tests.reference import make_tiny_net


def checkpointer(store, rank, strategy_name="allreduce", every=3, **settings):
    config = SparkDLConfig().replace(num_workers=1, strategy=strategy_name, **settings)
    module = make_tiny_net()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    strategy = create_strategy(StrategyContext(config, 0, 1, torch.device("cpu"), module, optimizer))
    return Checkpointer(store, every, rank, module, optimizer, strategy), strategy


def tally(epoch=1):
    return EpochTally(epoch, -1, 0.0)


def test_rank_0_checkpoints_every_n_steps_and_at_epoch_ends_and_a_worker_restores_it(gloo_group, tmp_path):
    store = CheckpointStore(str(tmp_path))
    writer, strategy = checkpointer(store, rank=0)
    try:
        hook = CheckpointHook(writer)
        for step in range(1, 8):
            hook.after_step(Position(1, step, step), tally())
        assert store.steps() == [3, 6]
        hook.after_epoch(Position(2, 0, 7), tally(), [{"epoch": 1, "loss": 0.5}])
        assert store.steps()[-1] == 7 and writer.written == 3
        reader, other = checkpointer(store, rank=1)
        resume = restore(store, 7, 1, reader.module, reader.optimizer)
        other.close()
        assert resume.position == Position(2, 0, 7)
        assert resume.history == [{"epoch": 1, "loss": 0.5}]
        for name, value in writer.module.state_dict().items():
            assert torch.equal(reader.module.state_dict()[name], value)
    finally:
        strategy.close()
        store.close()


def test_other_ranks_write_nothing(gloo_group, tmp_path):
    store = CheckpointStore(str(tmp_path))
    writer, strategy = checkpointer(store, rank=1)
    try:
        CheckpointHook(writer).after_step(Position(1, 3, 3), tally())
        CheckpointHook(writer).after_epoch(Position(2, 0, 3), tally(), [])
        assert store.steps() == []
    finally:
        strategy.close()
        store.close()


def test_weight_averaging_checkpoints_an_epoch_end_only_on_an_average(gloo_group, tmp_path):
    store = CheckpointStore(str(tmp_path))
    writer, _ = checkpointer(store, 0, "weight_averaging", every=0, sync_every=4)
    try:
        hook = CheckpointHook(writer)
        hook.after_epoch(Position(2, 0, 6), tally(), [])  # 6 is not a multiple of tau = 4
        hook.after_epoch(Position(3, 0, 8), tally(), [])
        assert store.steps() == [8]
    finally:
        store.close()


def test_the_random_stream_of_a_step_depends_only_on_seed_rank_and_step():
    hook = ReseedHook(seed=3, stream=1)
    hook.before_step(Position(1, 0, 42))
    first = torch.rand(3)
    torch.rand(10)  # whatever ran in between
    hook.before_step(Position(5, 9, 42))
    assert torch.equal(torch.rand(3), first)
    ReseedHook(seed=3, stream=0).before_step(Position(1, 0, 42))
    assert not torch.equal(torch.rand(3), first)


def test_progress_goes_out_when_due_and_once_at_the_epoch_end_with_the_loss_read_then():
    sent, due = [], iter([False, True, False])
    hook = ProgressHook(sent.append, lambda: next(due), clock=lambda: 10.0)
    running = EpochTally(2, 30, started=4.0, steps=5, samples=40, loss_sum=torch.tensor(8.0))
    for _ in range(3):
        hook.after_step(Position(2, 5, 35), running)
    assert len(sent) == 1 and (sent[0].steps, sent[0].total_steps, sent[0].loss_sum) == (5, 30, 8.0)
    hook.after_epoch(Position(3, 0, 35), running, [])
    assert sent[-1].total_steps == 5 and sent[-1].seconds == 6.0  # the final report knows the total
    assert sent[-1].val_loss is None and sent[0].val_loss is None
    hook.after_epoch(Position(3, 0, 35), running, [{"epoch": 2, "val_loss": 0.75}])
    assert sent[-1].val_loss == 0.75  # the epoch's validation loss reaches the bar
