"""The shared-memory all-reduce among the workers of one host: real processes, a real gloo
group for its setup, real Unix sockets and a real segment (in a test directory, so that
what it leaves behind can be seen)."""

from __future__ import annotations

import os
import socket
import time
import traceback

import numpy as np
import pytest
import torch

from sparkdl.comm import shared_memory
from sparkdl.comm.shared_memory import SharedMemoryGroup, area_bytes_for
from sparkdl.comm.shared_memory_setup import HELLO, SegmentSetup
from sparkdl.errors import CollectiveError
from tests.workers import worker_context

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux shared memory")

BIG = 400_000  # float32: 1.6 MB, so 3 workers x BIG sum by slices (two barriers a round)
PAYLOAD = 4 * BIG


def _inputs(rank: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rank)
    return {
        "big": rng.normal(size=BIG).astype(np.float32),
        "parts": rng.normal(size=3 * BIG + 7).astype(np.float32),  # more than an area: 4 rounds
        "small": rng.normal(size=1_001).astype(np.float64),  # every worker sums it all (one barrier)
        "ints": rng.integers(-1_000, 1_000, size=333).astype(np.int64),
    }


def _run(rank, world, init, directory, scenario, out, timeout_s=30.0):
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        group = SharedMemoryGroup.form(list(range(world)), rank, None, PAYLOAD, timeout_s, directory)
        out.put((rank, scenario(rank, group)))
    except BaseException:
        out.put((rank, traceback.format_exc()))
    finally:
        # the scenario ends with the group still open where it wants the others to see it leave
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(tmp_path, world, scenario, directory=None, timeout_s=30.0):
    ctx = worker_context()
    out = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    directory = str(directory or tmp_path)
    args = (world, init, directory, scenario, out, timeout_s)
    procs = [ctx.Process(target=_run, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    return results


def _sums_and_broadcast(rank, group):
    tensors = {name: torch.from_numpy(a) for name, a in _inputs(rank).items()}
    for tensor in tensors.values():
        group.all_reduce_(tensor)
    leader = torch.full((5,), float(rank))
    group.broadcast_(leader)
    result = {name: t.numpy() for name, t in tensors.items()}
    result["broadcast"] = leader.numpy()
    group.close()
    return result


@pytest.mark.slow
def test_three_workers_get_the_sums_in_rank_order_bit_for_bit_and_nothing_is_left_behind(tmp_path):
    results = _spawn(tmp_path, 3, _sums_and_broadcast)
    for rank in range(3):
        assert isinstance(results[rank], dict), results[rank]
    every = [_inputs(rank) for rank in range(3)]
    for name in every[0]:
        expected = (every[0][name] + every[1][name]) + every[2][name]  # rank order, in the dtype
        for rank in range(3):
            assert results[rank][name].dtype == expected.dtype
            np.testing.assert_array_equal(results[rank][name], expected, err_msg=f"{name} on rank {rank}")
    for rank in range(3):
        np.testing.assert_array_equal(results[rank]["broadcast"], np.zeros(5, dtype=np.float32))
    # the segment's directory is gone
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("sparkdl-")]


def _formed(rank, group):
    return group is not None


@pytest.mark.slow
def test_every_worker_keeps_gloo_when_the_leader_cannot_create_the_segment(tmp_path):
    results = _spawn(tmp_path, 2, _formed, directory=tmp_path / "missing")
    assert results == {0: False, 1: False}


def _leaves(rank, group):
    """Rank 1 leaves in the middle of a step; rank 0 waits for it in the next round."""
    if rank == 1:
        group.close()
        return "left"
    started = time.monotonic()
    try:
        group.all_reduce_(torch.ones(10))
    except CollectiveError as exc:
        first, waited = str(exc), time.monotonic() - started
    else:
        return "no error"
    try:
        group.all_reduce_(torch.ones(10))
    except CollectiveError as exc:
        return (first, waited, str(exc))
    return "no error the second time"


@pytest.mark.slow
def test_a_worker_that_leaves_stops_the_others_at_once_and_the_group_stays_broken(tmp_path):
    results = _spawn(tmp_path, 2, _leaves, timeout_s=60.0)
    first, waited, then = results[0]
    assert "rank 1 of the same host closed its connection" in first
    assert waited < 10  # not the 60 s timeout
    assert "failed earlier" in then and "rank 1" in then


def _stalls(rank, group):
    """Rank 1 arrives late, rank 2 not at all: the leader waits one timeout in all."""
    if rank == 2:
        time.sleep(4)
        group.close()
        return "stalled"
    if rank == 1:
        time.sleep(0.6)
    started = time.monotonic()
    try:
        group.all_reduce_(torch.ones(10))
    except CollectiveError as exc:
        timeout = (type(exc).__name__, getattr(exc, "setting", None), getattr(exc, "limit_s", None))
        return (str(exc), time.monotonic() - started, timeout)
    return "no error"


@pytest.mark.slow
def test_a_stalled_worker_is_reported_after_one_collective_timeout(tmp_path):
    results = _spawn(tmp_path, 3, _stalls, timeout_s=1.0)
    message, waited, timeout = results[0]
    assert "waited 1s for rank 2" in message and "runtime.collective_timeout_s" in message
    assert timeout == ("CollectiveTimeout", "runtime.collective_timeout_s", 1.0)  # the family's fields
    assert 0.9 <= waited < 1.5  # one deadline for the barrier, not one timeout per member
    assert "rank 0 of the same host closed its connection" in results[1][0]  # the leader gave up


# -- setup, in one process: what a stranger can do to the leader ------------------------


def _leader(tmp_path, timeout_s=1.0):
    setup = SegmentSetup(local_rank=0, size=2, total=64 + 6 * 1024, timeout_s=timeout_s)
    directory = setup.create(str(tmp_path))
    assert directory and setup.ok
    return setup, directory


def test_a_connection_without_the_token_is_refused(tmp_path):
    setup, directory = _leader(tmp_path)
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger.connect(os.path.join(directory, "socket"))
    stranger.sendall(HELLO.pack(b"x" * 32, 1))
    setup.accept_members()
    assert "did not present the segment's token" in setup.reason
    setup.remove_directory()
    setup.close_listener()
    setup.abandon()
    stranger.close()
    assert not os.listdir(tmp_path)


def test_a_connection_that_says_nothing_is_dropped_after_the_timeout(tmp_path):
    setup, directory = _leader(tmp_path, timeout_s=0.3)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(os.path.join(directory, "socket"))
    started = time.monotonic()
    setup.accept_members()
    assert time.monotonic() - started < 2
    assert "did not all connect" in setup.reason
    setup.remove_directory()
    setup.close_listener()
    setup.abandon()
    silent.close()


def test_a_member_refuses_a_segment_of_another_size(tmp_path):
    setup, directory = _leader(tmp_path)
    member = SegmentSetup(local_rank=1, size=2, total=64 + 6 * 2048, timeout_s=1.0)
    member.attach(directory)
    assert "holds" in member.reason and str(64 + 6 * 1024) in member.reason
    setup.remove_directory()
    setup.close_listener()
    setup.abandon()


def test_areas_are_cache_lines_up_to_the_cap():
    assert area_bytes_for(1) == 64
    assert area_bytes_for(340_040) == 340_096
    assert area_bytes_for(10**9) == shared_memory.MAX_AREA_BYTES
