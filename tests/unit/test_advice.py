"""The advisor's arithmetic (sparkdl.advisor.predict): modelled candidates, the run's epoch, the
recommendation and the link estimate, on hand-made probe figures."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sparkdl.advisor.advise import chosen_candidates
from sparkdl.advisor.costmodel import ModelShape
from sparkdl.advisor.predict import LOCAL, Candidate, LinkEstimate, ProbeResult, Timing, predict, probe_set
from sparkdl.config import Strategy
from sparkdl.errors import ConfigError
from sparkdl.strategies import REGISTRY, strategy_class

MODEL_BYTES = 4 * 85_000
#: how each strategy exchanges, as the strategy classes themselves declare it (advise passes the same)
PATTERNS = {name: strategy_class(name).pattern for name in REGISTRY}


def _probe(**timings: Timing) -> ProbeResult:
    return ProbeResult(
        workers=2,
        batch_size=128,
        params=85_000,
        timings={LOCAL: Timing(0.002, 0.05, 0.0), **timings},
        skipped={"fsdp": "fsdp with precision 'fp16': use bf16"},
        link=LinkEstimate(50e-6, 1e9),
    )


TIMINGS = {
    "allreduce": Timing(0.004, 0.06, MODEL_BYTES),
    "weight_averaging tau=1": Timing(0.006, 0.07, MODEL_BYTES),
    # a local step plus a quarter of the average, plus 0.5 ms waiting for the drifted worker
    "weight_averaging tau=4": Timing(0.0035, 0.07, MODEL_BYTES / 4),
    "parameter_server sync": Timing(0.008, 0.08, 2 * MODEL_BYTES),
    "parameter_server async": Timing(0.005, 0.10, 2 * MODEL_BYTES),
    "parameter_server async push/pull every 4": Timing(0.0025, 0.10, MODEL_BYTES / 2),
}


def _advice(rows: int = 256_000, **extra: Timing):
    probed, derived = probe_set(tau=8, staleness=0, every=8)
    probe = _probe(**{**TIMINGS, **extra})
    return predict(probe, probed, derived, rows, project_to=(8, 32), patterns=PATTERNS)


def test_a_measured_candidate_runs_its_steps_plus_its_epoch_overhead():
    advice = _advice()
    row = advice.prediction("allreduce")
    steps = 256_000 // (2 * 128)  # 1,000 steps of 2 x 128 rows
    assert row.epoch_s == pytest.approx(steps * 0.004 + 0.06)
    assert row.samples_per_s == pytest.approx(256_000 / (steps * 0.004 + 0.06))
    assert row.source == "measured" and row.bytes_per_step == MODEL_BYTES


def test_weight_averaging_every_tau_steps_follows_c_plus_d_over_tau_through_the_probed_taus():
    advice = _advice()
    exchange = (0.006 - 0.0035) / (1 - 1 / 4)  # d: fitted through tau = 1 and tau = 4
    for tau in (8, 16):  # 8: the estimator's own sync_every
        row = advice.prediction(f"weight_averaging tau={tau}")
        step_s = (0.006 - exchange) + exchange / tau
        assert row.epoch_s == pytest.approx(1000 * step_s + 0.07)
        assert row.bytes_per_step == pytest.approx(MODEL_BYTES / tau)
        assert "c + d/k through weight_averaging tau=1 and" in row.source and not row.exact
    assert advice.prediction("weight_averaging tau=4").source == "measured"


def test_asynchronous_pushes_every_k_steps_follow_the_probed_k_and_ssp_lies_between_sync_and_async():
    advice = _advice()
    every8 = advice.prediction("parameter_server async push/pull every 8")  # the estimator's push_every
    # through k = 1 (5 ms) and 4 (2.5 ms): c = 1.67 ms is under the local step (2 ms), so c is
    # the local step and d is refitted through the measured k = 4
    step_s = 0.002 + (0.0025 - 0.002) * 4 / 8
    assert every8.epoch_s == pytest.approx(1000 * step_s + 0.10)
    assert every8.source == (
        "modelled: c + d/k through parameter_server async and parameter_server async push/pull every 4"
    )
    ssp = advice.prediction("parameter_server ssp s=2")
    sync, async_ = advice.prediction("parameter_server sync"), advice.prediction("parameter_server async")
    assert async_.samples_per_s > ssp.samples_per_s > sync.samples_per_s


def test_the_recommendation_is_the_fastest_exact_candidate_and_names_a_much_faster_approximate_one():
    advice = _advice()
    assert [r.samples_per_s for r in advice.rows] == sorted(
        (r.samples_per_s for r in advice.rows), reverse=True
    )
    assert advice.recommended.name == "allreduce"  # faster than sync PS and tau=1
    assert advice.fastest.name == "parameter_server async push/pull every 8"
    summary = advice.summary()
    assert "strategy='allreduce'" in summary
    assert "parameter_server async push/pull every 8 is predicted" in summary
    assert "check its accuracy" in summary


def test_across_hosts_all_reduce_is_also_probed_through_each_hosts_shared_memory_and_wins_if_faster():
    one_host = {c.name for c in probe_set(tau=8, staleness=0, every=8)[0]}
    probed, derived = probe_set(tau=8, staleness=0, every=8, hosts=2)
    assert {c.name for c in probed} - one_host == {"allreduce hierarchy=host"}
    (host_level,) = [c for c in probed if c.name == "allreduce hierarchy=host"]
    assert host_level.exact and host_level.settings["hierarchy"] == "host"
    assert host_level.settings["compression"] == "none"  # a hierarchy sums uncompressed
    faster = _probe(**{**TIMINGS, "allreduce hierarchy=host": Timing(0.0028, 0.06, MODEL_BYTES)})
    advice = predict(faster, probed, derived, 256_000, patterns=PATTERNS)
    assert advice.recommended.name == "allreduce hierarchy=host"  # 30% faster than flat, the same step
    assert advice.recommended.settings["hierarchy"] == "host"
    tied = _probe(**{**TIMINGS, "allreduce hierarchy=host": Timing(0.0039, 0.06, MODEL_BYTES)})
    assert predict(tied, probed, derived, 256_000, patterns=PATTERNS).recommended.name == "allreduce"


def test_an_exact_candidate_within_a_tenth_of_the_fastest_gives_way_to_all_reduce():
    tied = _advice(**{"parameter_server sync": Timing(0.0038, 0.06, 2 * MODEL_BYTES)})
    assert tied.rows.index(tied.prediction("parameter_server sync")) < tied.rows.index(
        tied.prediction("allreduce")
    )
    assert tied.recommended.name == "allreduce"  # 5% slower: within the probe's resolution
    clear = _advice(**{"parameter_server sync": Timing(0.003, 0.06, 2 * MODEL_BYTES)})
    assert clear.recommended.name == "parameter_server sync"


def test_a_candidate_not_probed_and_those_modelled_from_it_are_listed_with_the_reason():
    advice = _advice()
    assert advice.skipped["fsdp"] == "fsdp with precision 'fp16': use bf16"
    assert "weight_averaging tau=1 1bit" in advice.skipped  # not in the probe's timings
    assert advice.skipped["weight_averaging tau=4 1bit"] == "not run"
    assert "which was not probed" in advice.skipped["weight_averaging tau=8 1bit"]
    table = advice.table()
    assert "not probed: fsdp with precision 'fp16'" in table
    with pytest.raises(KeyError, match="no prediction named 'fsdp'"):
        advice.prediction("fsdp")


def test_without_the_local_step_there_is_nothing_to_model_from():
    probe = ProbeResult(
        2, 128, 10, {"allreduce": Timing(0.1, 0.0, 4.0)}, {LOCAL: "boom"}, LinkEstimate(1e-5, 1e9)
    )
    with pytest.raises(ValueError, match="no 'local' timing: boom"):
        predict(probe, [Candidate("allreduce", {})], [], 1000)


def test_one_worker_has_no_link_to_measure_and_no_projection():
    link = LinkEstimate.from_all_reduce(1, tiny_s=0.0001, model_s=0.0001, model_bytes=8e6)
    assert (link.latency_s, link.bytes_per_s) == (0.0, 0.0)  # unknown: JSON has no Infinity
    probe = dataclasses.replace(_probe(**TIMINGS), workers=1, link=link)
    probed, derived = probe_set(tau=8, staleness=0, every=8)
    advice = predict(probe, probed, derived, 1000, project_to=(8,), patterns=PATTERNS)
    assert advice.projections == {} and "link: not measured (one worker" in advice.table()
    json.dumps(advice.to_dict(), allow_nan=False)


def test_the_link_follows_from_a_tiny_and_a_model_sized_ring_all_reduce():
    # 4 workers: 6 messages; each sends 2 * 3/4 of 8 MB = 12 MB in (0.106 - 0.006) s
    link = LinkEstimate.from_all_reduce(4, tiny_s=0.006, model_s=0.106, model_bytes=8e6)
    assert link.latency_s == pytest.approx(0.001)
    assert link.bytes_per_s == pytest.approx(12e6 / 0.1)


def test_projections_grow_with_workers_for_all_reduce_and_stall_for_one_server():
    advice = _advice()
    projected = advice.projections
    assert projected["allreduce"][32] > projected["allreduce"][8]
    ps = projected["parameter_server sync"]
    assert ps[32] < 1.5 * ps[8]  # one server's link carries every worker's push and pull
    assert set(advice.to_dict()["projections"]["allreduce"]) == {"8", "32"}


def test_a_strategies_filter_keeps_what_its_modelled_rows_follow_from_and_refuses_unknown_names():
    probed, derived = probe_set(tau=4, staleness=0, every=1)
    kept, modelled = chosen_candidates(probed, derived, ["weight_averaging tau=16"])  # a prefix
    assert [d.candidate.name for d in modelled] == ["weight_averaging tau=16", "weight_averaging tau=16 1bit"]
    assert {c.name for c in kept} == {
        LOCAL,
        "weight_averaging tau=1",
        "weight_averaging tau=4",
        "weight_averaging tau=1 1bit",
        "weight_averaging tau=4 1bit",
    }
    with pytest.raises(ConfigError, match=r"got \['all_reduce'\], which start no candidate's name"):
        chosen_candidates(probed, derived, ["all_reduce"])


def test_each_strategy_declares_how_it_exchanges_and_the_projections_follow_it():
    from sparkdl.comm.traffic import Pattern

    assert PATTERNS == {
        Strategy.ALLREDUCE: Pattern.RING_OVERLAPPED,
        Strategy.WEIGHT_AVERAGING: Pattern.RING_PERIODIC,
        Strategy.PARAMETER_SERVER: Pattern.STAR,
        Strategy.FSDP: Pattern.FULL_SHARD,
        Strategy.PIPELINE: Pattern.PIPELINE,
        Strategy.TENSOR: Pattern.TENSOR,
    }
    unpriced = {**PATTERNS, Strategy.PARAMETER_SERVER: None}
    probed, derived = probe_set(tau=8, staleness=0, every=8)
    advice = predict(_probe(**TIMINGS), probed, derived, 256_000, project_to=(8,), patterns=unpriced)
    assert "parameter_server sync" not in advice.projections and "allreduce" in advice.projections


def test_model_parallel_rows_are_projected_only_where_the_model_has_a_cut_or_a_split():
    advice = _advice()  # the probe read no shape: no cut, no split pair, no linear layer
    assert "fsdp" not in advice.projections  # the probe skipped it: its settings refused it
    assert not {"pipeline", "tensor", "allreduce, sufficient factors"} & set(advice.projections)
    shape = ModelShape(
        linears=((64, 512), (512, 64)),
        cut_bytes=(2048.0,),
        stage_params=(40_000, 45_000),
        split_bytes=4096.0,
        split_collectives=2,
        split_params=65_000,
        input_bytes=256.0,
        label_bytes=8.0,
    )
    probed, derived = probe_set(tau=8, staleness=0, every=8)
    probe = dataclasses.replace(_probe(**TIMINGS), shape=shape, microbatches=4, skipped={})
    projected = predict(probe, probed, derived, 256_000, project_to=(3, 8), patterns=PATTERNS).projections
    assert set(projected["fsdp"]) == {3, 8}
    assert set(projected["pipeline"]) == {8}  # its 2 stages, replicated: multiples of 2 only
    assert set(projected["tensor"]) == {8}  # groups of the probe's 2 workers
    assert set(projected["allreduce, sufficient factors"]) == {3, 8}
    # at 128 rows a worker, 64 x 512 layers send more as factors than as matrices: the plain ring's
    assert projected["allreduce, sufficient factors"][8] == pytest.approx(projected["allreduce"][8])
