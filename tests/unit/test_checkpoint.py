import pickle
import threading
from types import SimpleNamespace

import pytest
import torch

from sparkdl.errors import CheckpointError
from sparkdl.storage.checkpoint_store import CheckpointStore


def state(step):
    return {"format": 1, "model": {"w": torch.full((3,), float(step))}, "global_steps_done": step}


def test_save_is_atomic_and_keeps_the_newest_two(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for step in (4, 8, 12):
        store.save(step, state(step))
    assert store.steps() == [8, 12]
    assert store.load(12)["model"]["w"].tolist() == [12.0] * 3


def test_a_crash_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    store = CheckpointStore(str(tmp_path))
    store.save(4, state(4))
    (tmp_path / ".checkpoint-000000008.pt.999.tmp").write_bytes(b"half a checkpoint")  # killed mid-write

    def crash(*_):
        raise OSError("disk gone")

    monkeypatch.setattr("os.replace", crash)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*000000012"):
        store.save(12, state(12))
    assert store.latest() == 4
    assert store.load(4)["global_steps_done"] == 4


def test_garbage_and_pickle_bearing_files_are_refused(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.path_for(4).write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="refused checkpoint"):
        store.load(4)

    class Evil:
        def __reduce__(self):
            return (exec, ("import os; os._exit(3)",))

    store.path_for(8).write_bytes(pickle.dumps({"format": 1, "x": Evil()}))
    with pytest.raises(CheckpointError, match="refused checkpoint"):
        store.load(8)
    torch.save({"no": "format"}, store.path_for(12))
    with pytest.raises(CheckpointError, match="not a sparkdl checkpoint"):
        store.load(12)


def test_progress_is_overwritten_in_place(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for step in range(1, 30):
        store.record_progress(step)
    progress = store.progress()
    store.close()
    assert progress is not None and progress.step == 29 and progress.wall_time > 0


@pytest.mark.parametrize(("saved_fused", "run_fused"), [(None, True), (True, None)])
def test_a_resumed_optimizer_keeps_the_kernels_this_run_built_it_with(saved_fused, run_fused):
    """A checkpoint's param groups must not switch this run's optimizer between PyTorch's
    fused and default kernels (a fused GPU run's checkpoint resumed under fsdp, or an
    unfused one under a fused run's fp16 scaler); the step counters follow the kernels."""
    from sparkdl.training.checkpointing import keep_kernel_choice, kernel_choice

    def trained(fused):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.ones(4, 3)).square().sum().backward()
            optimizer.step()
        return model, optimizer

    _, saved = trained(saved_fused)
    model, optimizer = trained(run_fused)
    kernels = kernel_choice(optimizer)
    optimizer.load_state_dict(saved.state_dict())
    assert optimizer.param_groups[0]["fused"] == saved_fused  # what load_state_dict does
    keep_kernel_choice(optimizer, kernels)
    assert optimizer.param_groups[0]["fused"] == run_fused
    assert all(s["step"].item() == 2.0 for s in optimizer.state.values())
    optimizer.zero_grad()
    model(torch.ones(4, 3)).square().sum().backward()
    optimizer.step()  # the run's own kernel takes the loaded state
    assert all(s["step"].item() == 3.0 for s in optimizer.state.values())


@pytest.mark.parametrize(("saved_world", "world", "skip"), [(2, 2, 8), (4, 2, 0), (None, 2, 8)])
def test_a_checkpoint_of_another_world_resumes_its_epoch_from_the_first_step(
    tmp_path, saved_world, world, skip
):
    """The data is split anew for another number of workers: the steps a checkpoint of 4
    workers skipped are not the first steps of 2 workers' partitions, so the epoch starts
    over on the checkpoint's weights (a checkpoint from before world_size was saved: as is)."""
    from sparkdl.training.checkpointing import restore

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = {
        "format": 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 2,
        "epoch_steps_done": 8, "global_steps_done": 20, "history": "[]", "world_size": saved_world,
    }  # fmt: skip
    if saved_world is None:
        del saved["world_size"]
    store = CheckpointStore(str(tmp_path))
    store.save(20, saved)
    resumed = restore(store, 20, 0, model, optimizer, world_size=world)
    assert (resumed.position.epoch, resumed.position.epoch_steps_done) == (2, skip)
    assert resumed.position.global_steps_done == 20


class _RunsCode:
    """Pickles to a call of ``exec``: what a writer of the checkpoint folder could plant."""

    def __reduce__(self):
        return (exec, ("import os; os._exit(3)",))


def _shards(store, step, extra=None):
    """A one-process shards folder of ``step`` (a model and an optimizer's hyperparameters),
    and its checkpoint file naming it, as the ranks and rank 0 write them."""
    from sparkdl.storage import sharded

    parts = {"model": {"w": torch.arange(6.0)}, "optimizer": {"param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    if extra is not None:
        parts["optimizer"]["param_groups"][0]["evil"] = extra
    sharded.save(parts, store.shards_for(step))
    store.save(step, {**state(step), "model": {}, "shards": store.shards_for(step).name})


def test_shards_assemble_whole_and_folders_carrying_pickled_code_are_refused(tmp_path):
    from sparkdl.training.checkpointing import whole_checkpoint

    store = CheckpointStore(str(tmp_path))
    _shards(store, 4)
    whole = whole_checkpoint(store, 4)
    assert whole["model"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert whole["optimizer"]["param_groups"] == [{"lr": 0.1, "params": ["w"]}]
    # a non-tensor entry carrying code: DCP itself would run it (torch.load, weights_only=False)
    _shards(store, 8, extra=_RunsCode())
    with pytest.raises(CheckpointError, match=r"refused the checkpoint shards in .*000000008\.shards"):
        whole_checkpoint(store, 8)
    # the metadata replaced by a pickle that runs code: DCP reads it with plain pickle.load
    (store.shards_for(4) / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(CheckpointError, match=r"exec is not part of a checkpoint's metadata"):
        whole_checkpoint(store, 4)


def test_shards_go_with_their_checkpoint_and_orphaned_ones_are_pruned(tmp_path):
    store = CheckpointStore(str(tmp_path))
    _shards(store, 2)
    store.shards_for(3).mkdir()  # the ranks wrote step 3's shards; rank 0 died before its file
    for step in (4, 6):
        _shards(store, step)
    assert store.steps() == [4, 6]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint-000000004.pt", "checkpoint-000000004.shards",
        "checkpoint-000000006.pt", "checkpoint-000000006.shards",
    ]  # fmt: skip
    store.retract(6)  # a resumed run about to write step 6 again: unlisted first, then its shards gone
    assert store.steps() == [4] and not store.shards_for(6).exists()


class _ShardedStrategy:
    """What the checkpointer asks of a strategy whose parameters are sharded (fsdp's and
    tensor parallelism's side of it), over one plain tensor: its shards."""

    writes_shards = True
    checkpoint_multiple = 1

    def __init__(self, weight):
        self.weight = weight
        self.ctx = SimpleNamespace(world_size=1)

    def sharded_state(self):
        return {"model": {"w": self.weight}, "optimizer": {"param_groups": [{"lr": 0.1, "params": ["w"]}]}}

    def checkpoint_state(self, step):
        return {}


def _gated_writes(monkeypatch):
    """``sharded.save`` held until the returned event is set: a store that is slow to take them."""
    from sparkdl.storage import sharded

    gate, real = threading.Event(), sharded.save

    def slow(*args, **kwargs):
        assert gate.wait(30), "the test never let the write through"
        real(*args, **kwargs)

    monkeypatch.setattr(sharded, "save", slow)
    return gate


def test_shards_are_written_in_the_background_from_their_copy_in_host_memory(
    gloo_group, tmp_path, monkeypatch
):
    from sparkdl.training.checkpointing import Checkpointer, Position, whole_checkpoint

    gate = _gated_writes(monkeypatch)
    weight = torch.arange(4.0)
    store = CheckpointStore(str(tmp_path), background=True)
    writer = Checkpointer(store, 2, 0, torch.nn.Linear(1, 1), None, _ShardedStrategy(weight))
    writer.after_step(Position(1, 2, 2))  # returns while the store has not taken the shards
    assert store.steps() == [] and writer.written == 1
    weight.add_(100.0)  # training goes on, in place
    gate.set()
    store.close()  # waits for the write: then the checkpoint is visible, as it was at step 2
    assert store.steps() == [2]
    whole = whole_checkpoint(store, 2)
    assert whole["model"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0] and whole["global_steps_done"] == 2


def test_a_background_shard_write_that_fails_is_raised_at_the_next_save_or_at_close(
    gloo_group, tmp_path, monkeypatch
):
    from sparkdl.storage import sharded
    from sparkdl.training.checkpointing import Checkpointer, Position

    def full_disk(state, location, *args):
        raise CheckpointError(f"could not write the checkpoint shards to {location}: disk full")

    monkeypatch.setattr(sharded, "save", full_disk)
    store = CheckpointStore(str(tmp_path), background=True)
    writer = Checkpointer(store, 2, 0, torch.nn.Linear(1, 1), None, _ShardedStrategy(torch.ones(2)))
    writer.after_step(Position(1, 2, 2))
    with pytest.raises(CheckpointError, match=r"000000002\.shards: disk full"):
        writer.after_step(Position(1, 4, 4))  # the next checkpoint waits for this one, and fails with it
    assert store.steps() == []
    store.close()  # nothing left in flight


def _rank_whose_peer_fails_its_file(rank, port, folder, out):
    """Rank ``rank`` of 2 on loopback gloo: a sharded checkpoint at step 2 (rank 0's file write
    fails, in the background, after both ranks' shards are in), then the next one at step 4."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from sparkdl.training.checkpointing import Checkpointer, Position

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    try:
        checkpoints = CheckpointStore(folder, background=True, upload_timeout_s=30.0)
        if rank == 0:

            def full_disk(step, buffer):
                raise CheckpointError(f"could not write checkpoint {step}: disk full")

            checkpoints._write_local = full_disk  # the file that makes the shards visible
        writer = Checkpointer(
            checkpoints, 2, rank, torch.nn.Linear(1, 1), None, _ShardedStrategy(torch.ones(2))
        )
        writer.after_step(Position(1, 2, 2))
        try:
            writer.after_step(Position(1, 4, 4))
            out.put((rank, "no error"))
        except CheckpointError as exc:
            out.put((rank, str(exc)))
        checkpoints.close(failing=True)
    finally:
        dist.destroy_process_group()


def test_a_write_that_failed_on_one_rank_fails_the_next_checkpoint_on_every_rank(tmp_path):
    """Rank 0's file failed after both ranks' shards were written: rank 1's own write went
    well, yet it must not start the next one (its collectives would wait on rank 0): both
    raise at the next checkpoint, rank 1 naming the other rank's failure."""
    from tests.spark.processes import free_port
    from tests.workers import worker_context

    ctx = worker_context()
    out = ctx.Queue()
    port = free_port()
    ranks = [
        ctx.Process(target=_rank_whose_peer_fails_its_file, args=(r, port, str(tmp_path), out))
        for r in (0, 1)
    ]
    for process in ranks:
        process.start()
    said = dict(out.get(timeout=90) for _ in ranks)
    for process in ranks:
        process.join(30)
    assert "could not write checkpoint 2: disk full" in said[0], said
    assert "the previous checkpoint's write failed on 1 other rank(s)" in said[1], said
