"""A worker's teardown: it releases everything, in an order that cannot deadlock, and a
teardown that blocks anyway is ended by the watchdog instead of hanging its task."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.reference import make_shards
from tests.unit.test_worker_gloo import file_all_gather
from tests.workers import worker_context


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


def test_a_teardown_that_blocks_is_ended_with_every_thread_s_stack():
    done = _run(
        """
        import time
        from sparkdl.worker.teardown import TeardownWatchdog
        def release_process_groups_stuck():
            time.sleep(60)
        TeardownWatchdog(1.0, rank=3).arm()
        release_process_groups_stuck()
        """
    )
    assert done.returncode == 1
    assert "Timeout (0:00:01)!" in done.stderr
    assert "release_process_groups_stuck" in done.stderr  # the stack says where it was stuck


def test_a_teardown_that_finishes_in_time_disarms_the_watchdog():
    done = _run(
        """
        import time
        from sparkdl.worker.teardown import TeardownWatchdog
        watchdog = TeardownWatchdog(1.0, rank=0)
        watchdog.arm()
        watchdog.disarm()
        time.sleep(2.0)
        print("alive")
        """
    )
    assert (done.returncode, done.stdout.strip()) == (0, "alive")


def test_the_worker_daemon_freezes_its_imports_so_a_forked_worker_collects_only_its_own_objects():
    # the teardown's gc.collect() (freeing DDP's reducer) then skips torch's ~300k objects
    done = _run(
        """
        import gc, os
        from sparkdl.spark import daemon
        daemon._prepare()
        frozen = gc.get_freeze_count()
        child = os.fork()
        if child == 0:
            os._exit(0 if gc.get_freeze_count() > frozen - 100 else 1)  # inherited by the fork
        print(frozen, os.waitpid(child, 0)[1])
        """
    )
    frozen, child_status = map(int, done.stdout.split())
    assert frozen > 100_000 and child_status == 0, done.stderr


def _fits_in_one_process(rank, world, shards, spec, store_dir, fits, out):
    """Several fits back to back in one process, as a reused Spark Python worker runs them."""
    import threading

    import torch.distributed as dist

    from sparkdl.worker.assembly import Placement, run_worker
    from tests.reference import shard_to_batch

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    threads_before = threading.active_count()
    try:
        for fit in range(fits):
            x, y = shards[rank]
            gather = file_all_gather(os.path.join(store_dir, f"fit{fit}"), rank, world)
            run_worker(spec, iter([shard_to_batch(x, y)]), Placement(rank, world, "127.0.0.1"), gather)
            assert not dist.is_initialized(), "the process group outlived its fit"
        leaked = [t.name for t in threading.enumerate() if t.name.startswith("sparkdl-")]
        out.put(
            (rank, threading.active_count() - threads_before, leaked, os.environ.get("NCCL_SOCKET_IFNAME"))
        )
    except Exception as exc:  # reported to the test process
        out.put((rank, -1, [f"{type(exc).__name__}: {exc}"], None))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["allreduce", "weight_averaging", "parameter_server"])
def test_back_to_back_fits_in_one_process_release_everything(tmp_path, strategy):
    from sparkdl.config import SparkDLConfig
    from sparkdl.spark.ps_host import host_parameter_server
    from sparkdl.worker.assembly import TrainSpec
    from tests.reference import make_tiny_net, shard_plan
    from tests.unit.test_worker_gloo import _plain_sgd

    shards = make_shards([24, 17])
    config = SparkDLConfig().replace(
        num_workers=2,
        strategy=strategy,
        batch_size=8,
        epochs=2,
        collective_timeout_s=30.0,
        teardown_timeout_s=30.0,
        network_interface="lo",
    )
    plan, template = shard_plan(shards)
    spec = TrainSpec(config, make_tiny_net, _plain_sgd, "cross_entropy", plan, template)
    fits = 3
    hosted = host_parameter_server(spec, "127.0.0.1") if strategy == "parameter_server" else None
    if hosted is not None:
        spec = hosted.spec
        fits = 1  # one server serves one fit
    ctx = worker_context()
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_fits_in_one_process, args=(r, 2, shards, spec, str(tmp_path), fits, out))
        for r in range(2)
    ]
    try:
        for p in procs:
            p.start()
        results = sorted(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        if hosted is not None:
            hosted.stop()
    for rank, extra_threads, leaked, nccl_env in results:
        assert leaked == [] and extra_threads == 0, (rank, extra_threads, leaked)
        assert nccl_env is None  # network_interface is set for the fit only
    assert [p.exitcode for p in procs] == [0, 0]
