"""The cost model: its exchanges' byte counts, and its predictions against the figures
measured on slow-net (benchmarks/results/compression_*.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkdl.advisor.costmodel import OVERLAP, Cluster, Link, Workload, host_bytes, step_cost
from sparkdl.comm.traffic import Pattern

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks/results"
M = 100e6


@pytest.mark.parametrize(
    ("exchange", "workers", "per_host", "hierarchical", "compression", "expected"),
    [
        (Pattern.RING_OVERLAPPED, 2, 1, False, "none", M),  # ring of 2: each sends the model once
        (Pattern.RING_OVERLAPPED, 8, 1, False, "none", 2 * 7 / 8 * M),
        (Pattern.RING_OVERLAPPED, 8, 4, True, "none", M),  # two leaders
        (Pattern.RING_OVERLAPPED, 8, 8, True, "none", 0.0),  # one host: nothing leaves it
        (Pattern.RING_OVERLAPPED, 8, 1, False, "1bit", 7 * M / 30),  # all-gather of 1/30 payloads
        (Pattern.STAR, 8, 4, False, "none", 8 * M),  # the server's NIC
        (Pattern.STAR, 8, 4, True, "none", 2 * M),  # one push per host
        (Pattern.STAR, 8, 4, True, "fp16", 2 * M),  # the pulls: float32
    ],
)
def test_bytes_through_the_busiest_host(exchange, workers, per_host, hierarchical, compression, expected):
    sent = host_bytes(
        exchange, Cluster(workers, per_host), M, hierarchical=hierarchical, compression=compression
    )
    assert sent == pytest.approx(expected)


def test_all_reduce_hides_part_of_its_communication_behind_backward():
    work = Workload(params=25_000_000, compute_s=0.3, batch=32)
    fast = step_cost(Pattern.RING_OVERLAPPED, Cluster(16), Link(100), work)
    slow = step_cost(Pattern.RING_OVERLAPPED, Cluster(16), Link(1), work)
    assert fast.comm_s < 0.2  # shorter than backward: OVERLAP of it hidden
    assert fast.step_s == pytest.approx(0.3 + (1 - OVERLAP) * fast.comm_s)
    assert slow.step_s == pytest.approx(0.3 + slow.comm_s - OVERLAP * 0.2) and slow.speedup < 16
    averaged = step_cost(Pattern.RING_PERIODIC, Cluster(16), Link(1), work, tau=16)
    assert averaged.comm_s == pytest.approx(slow.comm_s / 16)
    with pytest.raises(ValueError, match="multiple of the workers per host"):
        Cluster(6, 4)


def _measured(name):
    return json.loads((RESULTS / f"compression_{name}.json").read_text())


FIXED_S = 3.0  # a fit's fixed cost on this machine (docs/benchmarks/history.md: first fit, later fits)


@pytest.mark.parametrize(
    ("link_name", "gbit", "row", "exchange", "compression", "tau"),
    [
        ("1gbit", 1.0, "allreduce", Pattern.RING_OVERLAPPED, "none", 1),
        ("1gbit", 1.0, "allreduce 1bit", Pattern.RING_OVERLAPPED, "1bit", 1),
        ("1gbit", 1.0, "weight_averaging tau=4", Pattern.RING_PERIODIC, "none", 4),
        ("1gbit", 1.0, "weight_averaging tau=4 1bit", Pattern.RING_PERIODIC, "1bit", 4),
        ("1gbit", 1.0, "allreduce fp16", Pattern.RING_OVERLAPPED, "fp16", 1),
        ("1gbit", 1.0, "parameter_server sync", Pattern.STAR, "none", 1),
        ("1gbit", 1.0, "parameter_server sync 1bit", Pattern.STAR, "1bit", 1),
        ("100mbit", 0.1, "allreduce", Pattern.RING_OVERLAPPED, "none", 1),
        ("100mbit", 0.1, "allreduce 1bit", Pattern.RING_OVERLAPPED, "1bit", 1),
        ("100mbit", 0.1, "weight_averaging tau=4 1bit", Pattern.RING_PERIODIC, "1bit", 4),
    ],
)
def test_predictions_are_within_a_quarter_of_the_measured_slow_link_fits(
    link_name, gbit, row, exchange, compression, tau
):
    """Calibrated on the loopback run only (its per-step compute, codecs included): the
    slow link's fit time follows from the bytes."""
    loopback, measured = _measured("loopback"), _measured(link_name)
    setup, params = measured["setup"], measured["setup"]["parameters"]
    model = 4 * params
    steps_loopback = loopback["results"]["allreduce"]["bytes_sent_per_worker"] / model  # ring of 2: M a step
    steps = measured["results"]["allreduce"]["bytes_sent_per_worker"] / model
    compute_s = (loopback["results"][row]["fit_s"] - FIXED_S) / steps_loopback
    work = Workload(params, compute_s, setup["batch_size_per_worker"], state_copies=1)  # momentum 0.5
    cost = step_cost(exchange, Cluster(2, 2), Link(gbit, shared=True), work, compression=compression, tau=tau)
    predicted = FIXED_S + steps * cost.step_s
    actual = measured["results"][row]["fit_s"]
    assert predicted == pytest.approx(actual, rel=0.25), (predicted, actual)
