"""The advisor for full-batch L-BFGS (sparkdl.advisor.full_batch and the cost model's pass):
where its vectors live, what a pass costs in each layout, on hand-made probe figures."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sparkdl.advisor.costmodel import Cluster, Link, Workload
from sparkdl.advisor.full_batch import (
    LAYOUTS,
    SERVED_PROBE,
    FullBatchRun,
    chosen_layouts,
    full_batch_candidates,
    full_batch_pass,
    layout_settings,
    lbfgs_vector_ops,
    predict_full_batch,
)
from sparkdl.advisor.predict import LOCAL, LinkEstimate, ProbeResult, Timing
from sparkdl.errors import ConfigError

PARAMS = 1_000_000  # 4 MB of float32
LINK = LinkEstimate(latency_s=1e-4, bytes_per_s=1e8)  # 0.8 Gbit/s
#: 2,000 rows a worker in batches of 100: 20 batches a pass; weight decay; the algebra 1 ms a
#: vector on the workers, 2 ms on the driver (where the shards' runs)
RUN = FullBatchRun(
    total_rows=4_000,
    batches=20,
    history=10,
    shards=2,
    weight_decay=True,
    worker_op_s=0.001,
    driver_op_s=0.002,
)
RING_LINK_S = 2 * 1e-4 + 4e6 / 1e8  # a ring of 2: two messages, each worker sends the 4 MB gradient once
RING_PASS_S = 20 * 0.01 + 64 * 0.001 + RING_LINK_S + 0.05  # batches, algebra, sum, the epoch's overhead


def _probe(local_s: float = 0.01, served_s: float | None = 0.10, workers: int = 2) -> ProbeResult:
    timings = {LOCAL: Timing(local_s, 0.05, 0.0)}
    if served_s is not None:
        timings[SERVED_PROBE] = Timing(served_s, 0.05, 4.0 * PARAMS + 120)
    link = LINK if workers > 1 else LinkEstimate(0.0, 0.0)
    return ProbeResult(workers=workers, batch_size=100, params=PARAMS, timings=timings, skipped={}, link=link)


def test_a_pass_is_its_batches_then_one_exchange_then_an_iterations_vector_algebra():
    # the iteration's 4 x 10 + 16, and the pass's own: 5 on a worker, 3 on the shards, 3 more for decay
    assert lbfgs_vector_ops(10, served=False, weight_decay=True) == 64
    assert lbfgs_vector_ops(10, served=True, weight_decay=False) == 59
    link, work = Link(0.8, 1e-4), Workload(params=PARAMS, compute_s=0.01, batch=100)
    ring = full_batch_pass(Cluster(2), link, work, 20, served=False, vector_op_s=0.001, weight_decay=True)
    assert ring.compute_s == pytest.approx(20 * 0.01 + 0.064)
    assert ring.comm_s == pytest.approx(RING_LINK_S)  # after the pass: nothing overlaps it
    assert ring.step_s == pytest.approx(ring.compute_s + ring.comm_s)
    assert ring.samples_per_s == pytest.approx(2 * 2_000 / ring.step_s)
    # to a server: the server's link carries both workers' pushes and pulls
    star = full_batch_pass(Cluster(2), link, work, 20, served=True, vector_op_s=0.001)
    assert star.comm_s == pytest.approx(2 * 1e-4 + 2 * 4e6 / 1e8)
    with pytest.raises(ValueError, match="at least one batch"):
        full_batch_pass(Cluster(2), link, work, 0, served=False)


def test_each_layout_is_its_batches_plus_its_exchange_its_algebra_and_the_epochs_overhead():
    advice = predict_full_batch(_probe(), RUN, list(LAYOUTS))
    ring, served = advice.prediction("lbfgs allreduce"), advice.prediction("lbfgs parameter_server")
    # the ring's sum priced from the link, its algebra on the workers; the server's push and
    # pull as probed (0.10 - 0.01), its algebra (62 operations) on the driver
    assert ring.epoch_s == pytest.approx(RING_PASS_S)
    assert served.epoch_s == pytest.approx(20 * 0.01 + 62 * 0.002 + 0.09 + 0.05)
    assert ring.samples_per_s == pytest.approx(4_000 / ring.epoch_s)
    assert ring.bytes_per_step == 4.0 * PARAMS and served.bytes_per_step == 4.0 * PARAMS + 120
    assert ring.exact and served.exact  # the same iterates either way
    assert advice.recommended.name == "lbfgs allreduce"
    assert advice.recommended.settings == {"strategy": "allreduce"}
    assert served.settings["strategy"] == "parameter_server" and served.settings["ps_mode"] == "sync"
    # the history's memory: 2 x 10 vectors of 4 MB on every worker, or halved over 2 shards
    assert "80.0 MB each" in ring.source
    assert "on the driver's 2 shards, 40.0 MB each (80.0 MB there)" in served.source
    table = advice.table()
    assert "pass s" in table and "MB/pass" in table and f"{ring.epoch_s:.4f}" in table
    assert "the same iterates" in advice.summary()


def test_all_reduce_wins_within_a_tenth_and_the_server_only_beyond_it():
    # a server 5% faster than the ring: within the tie, all-reduce (nothing more to host)
    quick_driver = dataclasses.replace(RUN, driver_op_s=0.001)
    push_pull_s = 0.95 * RING_PASS_S - (20 * 0.01 + 62 * 0.001 + 0.05)
    close = predict_full_batch(_probe(served_s=0.01 + push_pull_s), quick_driver, list(LAYOUTS))
    assert close.fastest.name == "lbfgs parameter_server"
    assert close.recommended.name == "lbfgs allreduce"
    assert dataclasses.replace(close, preference=()).recommended.name == "lbfgs parameter_server"
    # a slow ring (a 0.08 Gbit/s link) against a server the probe found quick: the server
    slow = dataclasses.replace(_probe(served_s=0.02), link=LinkEstimate(1e-4, 1e7))
    advice = predict_full_batch(slow, RUN, list(LAYOUTS))
    assert advice.recommended.name == "lbfgs parameter_server"
    assert advice.recommended.settings["strategy"] == "parameter_server"


def test_a_layout_the_settings_refuse_or_the_probe_missed_is_left_out_with_the_reason():
    refused = dataclasses.replace(RUN, refused={"lbfgs parameter_server": "validation on the server: ..."})
    advice = predict_full_batch(_probe(), refused, list(LAYOUTS))
    assert [row.name for row in advice.rows] == ["lbfgs allreduce"]
    assert advice.skipped == {"lbfgs parameter_server": "validation on the server: ..."}
    probe = dataclasses.replace(_probe(served_s=None), skipped={SERVED_PROBE: "no server over Connect"})
    advice = predict_full_batch(probe, RUN, list(LAYOUTS))
    assert advice.skipped == {"lbfgs parameter_server": "no server over Connect"}
    with pytest.raises(ValueError, match="no L-BFGS layout could be predicted"):
        predict_full_batch(probe, RUN, ["lbfgs parameter_server"])


def test_one_worker_has_no_exchange_and_no_projection():
    advice = predict_full_batch(_probe(workers=1), RUN, list(LAYOUTS), project_to=(8,))
    assert advice.prediction("lbfgs allreduce").epoch_s == pytest.approx(20 * 0.01 + 0.064 + 0.05)
    assert advice.projections == {}
    assert json.loads(json.dumps(advice.to_dict(), allow_nan=False))["unit"] == "pass"


def test_projections_spread_the_rows_over_more_workers_and_the_server_stalls():
    advice = predict_full_batch(_probe(), RUN, list(LAYOUTS), project_to=(2, 8, 32))
    ring, served = advice.projections["lbfgs allreduce"], advice.projections["lbfgs parameter_server"]
    # at the probed count, the ring's projection is its row (both priced from the link here)
    assert ring[2] == pytest.approx(advice.prediction("lbfgs allreduce").samples_per_s)
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
    assert ring.epoch_s == pytest.approx(RING_PASS_S - RING_LINK_S + 0.005)
    assert "the gradient's sum as probed" in ring.source


def test_each_layouts_settings_are_what_fit_checks_so_a_refused_one_is_skipped_with_fits_reason():
    from sparkdl.config import SparkDLConfig
    from sparkdl.strategies import check_settings

    lbfgs = SparkDLConfig().replace(optimizer="lbfgs", lr=1.0, ps_mode="async", validation_fraction=0.1)
    check_settings(lbfgs.replace(**layout_settings("lbfgs allreduce")))  # validated every iteration
    with pytest.raises(ConfigError, match="validation and strategy 'parameter_server'"):
        check_settings(lbfgs.replace(**layout_settings("lbfgs parameter_server")))  # its ps_mode pinned
    check_settings(lbfgs.replace(validation_fraction=0.0, **layout_settings("lbfgs parameter_server")))
