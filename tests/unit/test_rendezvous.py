"""Meeting at the driver's store: real TCPStores on loopback, real spawned ranks, no Spark."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
import traceback

import pytest

from sparkdl.errors import RendezvousError
from sparkdl.runtime.rendezvous import RendezvousEndpoint, RendezvousHost, form_process_group


def _never(_message: str) -> list[str]:
    raise AssertionError("the barrier's allGather was called although the driver's store was given")


def _rank(rank, world, endpoint, stage, task_attempt, out):
    import torch
    import torch.distributed as dist

    try:
        started = time.monotonic()
        groups = form_process_group(
            rank, world, "127.0.0.1", "gloo", _never, 30.0, task_attempt, endpoint, stage
        )
        joined_s = time.monotonic() - started
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        out.put((rank, groups.attempt, float(total), joined_s))
        groups.destroy()
    except BaseException:
        out.put((rank, traceback.format_exc(), None, None))


def _meet(endpoint, stage, attempts):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    world = len(attempts)
    procs = [
        ctx.Process(target=_rank, args=(r, world, endpoint, stage, attempts[r], out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {rank: rest for rank, *rest in (out.get(timeout=90) for _ in procs)}
    for p in procs:
        p.join(30)
    return results


@pytest.mark.slow
def test_two_stage_attempts_meet_at_the_driver_without_the_barriers_all_gather():
    host = RendezvousHost("127.0.0.1", 30.0)
    try:
        first = _meet(host.endpoint, "3.0", [41, 40, 42])
        retried = _meet(host.endpoint, "3.1", [57, 58, 59])  # the same store, the retry's own keys
    finally:
        host.close()
    assert {r: tuple(v[:2]) for r, v in first.items()} == {r: (40, 6.0) for r in range(3)}, first
    assert {r: tuple(v[:2]) for r, v in retried.items()} == {r: (57, 6.0) for r in range(3)}, retried
    # no second of the allGather's polling: spawned ranks start within a second or so of each other
    assert max(v[2] for v in first.values()) < 5


def test_a_driver_store_that_is_gone_is_a_rendezvous_error_in_the_timeout():
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # nothing listens there once closed
    started = time.monotonic()
    gone = RendezvousEndpoint("127.0.0.1", port)
    with pytest.raises(RendezvousError, match=r"driver's rendezvous store at 127\.0\.0\.1") as error:
        form_process_group(0, 2, "127.0.0.1", "gloo", _never, 2.0, 0, gone, "1.0")
    assert "spark.driver.host" in str(error.value)
    assert time.monotonic() - started < 30
