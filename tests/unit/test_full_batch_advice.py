"""The advisor for full-batch L-BFGS (sparkdl.advisor.full_batch and the cost model's pass):
where its vectors live, what a pass costs in each layout, on hand-made probe figures."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sparkdl.advisor.costmodel import Cluster, Link, Workload, full_batch_pass, lbfgs_vector_ops
from sparkdl.advisor.full_batch import (
    LAYOUTS,
    SERVED_PROBE,
    FullBatchRun,
    chosen_layouts,
    full_batch_candidates,
    predict_full_batch,
)
from sparkdl.advisor.predict import LOCAL, LinkEstimate, ProbeResult, Timing
from sparkdl.errors import ConfigError

PARAMS = 1_000_000  # 4 MB of float32
LINK = LinkEstimate(latency_s=1e-4, bytes_per_s=1e8)  # 0.8 Gbit/s
#: 2,000 rows a worker in batches of 100: 20 batches a pass
#: the algebra: 1 ms a vector on the workers, 2 ms on the driver (where the shards' runs)
RUN = FullBatchRun(total_rows=4_000, batches=20, history=10, shards=2, worker_op_s=0.001, driver_op_s=0.002)


def _probe(local_s: float = 0.01, served_s: float | None = 0.10, workers: int = 2) -> ProbeResult:
    timings = {LOCAL: Timing(local_s, 0.05, 0.0)}
    if served_s is not None:
        timings[SERVED_PROBE] = Timing(served_s, 0.05, 4.0 * PARAMS + 120)
    link = LINK if workers > 1 else LinkEstimate(0.0, 0.0)
    return ProbeResult(workers=workers, batch_size=100, params=PARAMS, timings=timings, skipped={}, link=link)


def test_a_pass_is_its_batches_then_one_exchange_then_an_iterations_vector_algebra():
    link, work = Link(0.8, 1e-4), Workload(params=PARAMS, compute_s=0.01, batch=100)
    ring = full_batch_pass(Cluster(2), link, work, 20, served=False, vector_op_s=0.001, history=10)
    # 20 batches, then 4 x 10 + 26 = 66 vector operations of 1 ms
    assert lbfgs_vector_ops(10) == 66
    assert ring.compute_s == pytest.approx(20 * 0.01 + 0.066)
    # a ring of 2: 2 messages, each worker sends the 4 MB gradient once; after the pass, not overlapped
    assert ring.comm_s == pytest.approx(2 * 1e-4 + 4e6 / 1e8)
    assert ring.step_s == pytest.approx(ring.compute_s + ring.comm_s)
    assert ring.samples_per_s == pytest.approx(2 * 2_000 / ring.step_s)
    # to a server: the server's link carries both workers' pushes and pulls
    star = full_batch_pass(Cluster(2), link, work, 20, served=True, vector_op_s=0.001, history=10)
    assert star.comm_s == pytest.approx(2 * 1e-4 + 2 * 4e6 / 1e8)
    with pytest.raises(ValueError, match="at least one batch"):
        full_batch_pass(Cluster(2), link, work, 0, served=False)


def test_each_layout_is_its_batches_plus_its_exchange_and_all_reduce_is_preferred_when_close():
    advice = predict_full_batch(_probe(), RUN, list(LAYOUTS))
    ring, served = advice.prediction("lbfgs allreduce"), advice.prediction("lbfgs parameter_server")
    # the ring's all-reduce is priced from the link, its algebra on the workers; the server's push
    # and pull as probed (0.10 - 0.01), its algebra on the driver; each replays the cache, with
    # the local epoch's 0.05 s of overhead
    assert ring.epoch_s == pytest.approx(20 * 0.01 + 66 * 0.001 + 2 * 1e-4 + 4e6 / 1e8 + 0.05)
    assert served.epoch_s == pytest.approx(20 * 0.01 + 66 * 0.002 + 0.09 + 0.05)
    assert ring.samples_per_s == pytest.approx(4_000 / ring.epoch_s)
    assert ring.bytes_per_step == 4.0 * PARAMS and served.bytes_per_step == 4.0 * PARAMS + 120
    assert ring.exact and served.exact  # the same iterates either way
    assert advice.recommended.name == "lbfgs allreduce"
    assert advice.recommended.settings == {"strategy": "allreduce"}
    # the history's memory: 2 x 10 vectors of 4 MB on every worker, or halved over 2 shards
    assert "80.0 MB each" in ring.source and "on the driver's 2 shards, 40.0 MB each" in served.source
    table = advice.table()
    assert "pass s" in table and "MB/pass" in table
    assert "the same iterates" in advice.summary()
    # within a tenth, all-reduce still wins: nothing more to host
    close = _probe(served_s=0.01 + 2 * 1e-4 + 4e6 / 1e8 - 0.066)
    assert predict_full_batch(close, RUN, list(LAYOUTS)).recommended.name == "lbfgs allreduce"


def test_the_server_is_recommended_only_where_its_pass_is_faster_by_more_than_a_tenth():
    # a slow ring (a 0.08 Gbit/s link) against a server the probe found quick
    slow = dataclasses.replace(_probe(served_s=0.02), link=LinkEstimate(1e-4, 1e7))
    advice = predict_full_batch(slow, RUN, list(LAYOUTS))
    assert advice.recommended.name == "lbfgs parameter_server"
    assert advice.recommended.settings == {"strategy": "parameter_server"}


def test_a_server_step_not_probed_leaves_its_layout_out_with_the_reason():
    probe = dataclasses.replace(_probe(served_s=None), skipped={SERVED_PROBE: "no server over Connect"})
    advice = predict_full_batch(probe, RUN, list(LAYOUTS))
    assert [row.name for row in advice.rows] == ["lbfgs allreduce"]
    assert advice.skipped == {"lbfgs parameter_server": "no server over Connect"}
    with pytest.raises(ValueError, match="no L-BFGS layout could be predicted"):
        predict_full_batch(probe, RUN, ["lbfgs parameter_server"])


def test_one_worker_has_no_exchange_and_no_projection():
    advice = predict_full_batch(_probe(workers=1), RUN, list(LAYOUTS), project_to=(8,))
    assert advice.prediction("lbfgs allreduce").epoch_s == pytest.approx(20 * 0.01 + 0.066 + 0.05)
    assert advice.projections == {}
    assert json.loads(json.dumps(advice.to_dict(), allow_nan=False))["unit"] == "pass"


def test_projections_spread_the_rows_over_more_workers_and_the_server_stalls():
    advice = predict_full_batch(_probe(), RUN, list(LAYOUTS), project_to=(2, 8, 32))
    ring, served = advice.projections["lbfgs allreduce"], advice.projections["lbfgs parameter_server"]
    assert ring[8] > ring[2]  # 5 batches a worker instead of 20, one ring all-reduce
    assert served[32] < served[8]  # the server's link carries 32 pushes and pulls a pass
    assert ring[32] > served[32]


def test_the_probe_times_a_step_wise_stand_in_and_the_server_only_where_it_is_a_layout():
    both = full_batch_candidates(list(LAYOUTS))
    assert [c.name for c in both] == [LOCAL, SERVED_PROBE]
    assert all(c.settings["optimizer"] == "sgd" for c in both)
    assert both[1].settings["ps_mode"] == "sync" and both[1].settings["backup_workers"] == 0
    assert [c.name for c in full_batch_candidates(["lbfgs allreduce"])] == [LOCAL]


def test_a_layout_is_chosen_by_its_row_name_or_its_strategy_and_a_step_wise_name_is_refused():
    assert chosen_layouts(None) == chosen_layouts([]) == list(LAYOUTS)
    assert chosen_layouts(["allreduce"]) == chosen_layouts(["lbfgs all"]) == ["lbfgs allreduce"]
    assert chosen_layouts(["parameter_server", "fsdp"]) == ["lbfgs parameter_server"]
    with pytest.raises(ConfigError, match=r"got \['fsdp'\]; with optimizer = 'lbfgs' the layouts are"):
        chosen_layouts(["fsdp"])


def test_the_sums_the_probe_timed_through_the_runs_exchange_replace_the_links_price():
    # one host's workers sum in shared memory, which the link's all-reduce never touched
    probe = dataclasses.replace(_probe(), gradient_sum_s=0.005)
    ring = predict_full_batch(probe, RUN, ["lbfgs allreduce"]).prediction("lbfgs allreduce")
    assert ring.epoch_s == pytest.approx(20 * 0.01 + 66 * 0.001 + 0.005 + 0.05)
    assert "the gradient's sum as probed" in ring.source
