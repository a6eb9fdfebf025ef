"""The cost model: its exchanges' byte counts, and its predictions against the figures
measured on slow-net (benchmarks/results/compression_*.json)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from sparkdl.advisor.costmodel import (
    OVERLAP,
    Cluster,
    Link,
    Workload,
    factor_bytes,
    host_bytes,
    pipeline_bytes,
    step_cost,
    tensor_bytes,
)
from sparkdl.advisor.shape import model_shape
from sparkdl.comm.traffic import Pattern
from sparkdl.config import SparkDLConfig
from sparkdl.data.tensors import Batch

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


def test_streaming_sends_a_rounds_bytes_in_fragments_each_hidden_behind_its_delay():
    work = Workload(params=25_000_000, compute_s=0.3, batch=32, state_copies=1)
    link, cluster = Link(1), Cluster(16)
    whole = step_cost(Pattern.RING_PERIODIC, cluster, link, work, tau=100)
    streamed = step_cost(Pattern.RING_PERIODIC, cluster, link, work, tau=100, fragments=4)
    state_free = step_cost(Pattern.RING_PERIODIC, cluster, link, Workload(25_000_000, 0.3, 32), tau=100)
    # the same weights, in four all-reduces of a quarter (latency four times); the state stays home
    assert streamed.comm_s == pytest.approx(state_free.comm_s + 3 * 2 * 15 * link.latency_s / 100)
    assert streamed.comm_s < whole.comm_s and streamed.step_s == pytest.approx(0.3 + streamed.comm_s)
    fragment = streamed.comm_s * 100 / 4
    overlapped = step_cost(Pattern.RING_PERIODIC, cluster, link, work, tau=100, fragments=4, delay=5)
    hidden = OVERLAP * min(5 * 0.3, fragment)
    assert overlapped.step_s == pytest.approx(0.3 + 4 * (fragment - hidden) / 100)
    assert overlapped.comm_s == pytest.approx(streamed.comm_s)  # hidden, not fewer bytes


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


def _wide_model() -> nn.Module:
    """benchmarks/bench_pipeline.py's wide MLP: 64 -> 4096 -> 4096 -> 4096 -> 10."""
    return nn.Sequential(
        nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
        nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10),
    )  # fmt: skip


def _wide_shape(strategy: str, **settings):
    torch.manual_seed(0)
    batch = Batch({"features": torch.randn(4, 64)}, torch.randint(0, 10, (4,)))
    config = SparkDLConfig().replace(num_workers=2, strategy=strategy, **settings)
    return model_shape(_wide_model(), batch, config, 2)


def _variant(name: str, row: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())["variants"][row]


def test_the_shape_of_the_wide_model_is_its_cut_and_its_split_pairs():
    shape = _wide_shape("pipeline")
    assert shape.cut_bytes == (4096 * 4,)  # after the second layer's ReLU: 4096 float32 a row
    assert shape.stage_params == (64 * 4096 + 4096 + 4096 * 4096 + 4096, 4096 * 4096 + 4096 + 4096 * 10 + 10)
    assert shape.linears == ((64, 4096), (4096, 4096), (4096, 4096), (4096, 10))
    assert shape.input_bytes == 64 * 4 and shape.label_bytes == 8
    # the split pairs (0, 2) and (4, 6): the rows layers' outputs and the third layer's input
    # gradient; the first layer's input is the model's, which has no gradient
    assert shape.split_bytes == (4096 + 4096 + 10) * 4 and shape.split_collectives == 3


def test_the_bytes_the_cost_model_gives_are_those_the_benchmarks_counted():
    """benchmarks/results: factors.json (32 rows a worker) and pipeline_wide_loopback.json (64 rows
    a worker, rank 0's counter over 3 epochs) counted exactly this a step; tensor parallelism's
    first epoch also sums the outputs of a forward of the template rows, once."""
    shape = _wide_shape("pipeline")
    params = sum(p.numel() for p in _wide_model().parameters())
    gathered, taken = factor_bytes(shape, 32, 2)
    factored = gathered + 4 * (params - taken)  # a ring of 2: each sends the rest once
    assert factored == _variant("factors", "allreduce, sufficient_factors auto")["bytes_sent_per_step"]
    stage0, _ = pipeline_bytes(shape, 64, replicas=1)
    assert stage0 == _variant("pipeline_wide_loopback", "pipeline 1f1b m=4")["bytes_sent_per_step"]
    split = tensor_bytes(_wide_shape("tensor"), params, 64, group=2, replicas=1)
    counted = _variant("pipeline_wide_loopback", "tensor parallel")["bytes_sent_per_step"]
    assert split == pytest.approx(counted, rel=2e-4)
    # data parallelism sends the weights: 1/64 and 1/32 of that here
    assert 4 * params / stage0 > 60 and 4 * params / split > 30


@pytest.mark.parametrize(
    ("row", "exchange"),
    [
        ("allreduce over gloo", Pattern.RING_OVERLAPPED),
        ("pipeline 1f1b m=4", Pattern.PIPELINE),
        ("tensor parallel", Pattern.TENSOR),
    ],
)
def test_model_parallel_predictions_are_within_a_fifth_of_the_measured_slow_link_fits(row, exchange):
    """The wide model on 2 workers, 64 rows each (benchmarks/bench_pipeline.py wide), loopback
    and slow-net 1 Gbit/s in one session: with the step's compute as loopback measured it, the
    slow link's samples/s follow from the bytes (one shared link carries both workers')."""
    loopback, measured = _variant("pipeline_wide_loopback", row), _variant("pipeline_wide_1gbit", row)
    strategy = {Pattern.PIPELINE: "pipeline", Pattern.TENSOR: "tensor"}.get(exchange, "allreduce")
    shape = _wide_shape(strategy)
    params = sum(p.numel() for p in _wide_model().parameters())
    step_s = 2 * 64 / loopback["samples_per_s"]
    work = Workload(params, step_s, 64, shape=shape, microbatches=4)
    local = step_cost(exchange, Cluster(2), Link(1000.0, latency_s=0.0, shared=True), work)  # loopback's
    work = dataclasses.replace(work, compute_s=step_s * step_s / local.step_s)  # its compute alone
    predicted = step_cost(exchange, Cluster(2), Link(1.0, shared=True), work).samples_per_s
    assert predicted == pytest.approx(measured["samples_per_s"], rel=0.2), (predicted, measured)


def test_model_parallel_steps_price_their_bubble_their_group_and_their_bytes():
    shape = _wide_shape("pipeline")
    params = sum(p.numel() for p in _wide_model().parameters())
    work = Workload(params, compute_s=0.3, batch=64, shape=shape, microbatches=4)
    link = Link(1.0)
    piped = step_cost(Pattern.PIPELINE, Cluster(2), link, work)
    assert piped.compute_s == pytest.approx(0.3 * 5 / 4)  # (m + p - 1) / m
    hops = 2 * 4 * 1  # each of 4 micro-batches over the cut and back
    assert piped.comm_s == pytest.approx(max(pipeline_bytes(shape, 64, 1)) / link.bytes_per_s + hops * 50e-6)
    reduced = step_cost(Pattern.RING_OVERLAPPED, Cluster(2), link, work)
    assert piped.samples_per_s > 2 * reduced.samples_per_s  # 2 MB of activations against 135 MB of weights
    # 4 workers as 2 pipelines: each stage's gradients all-reduced between the replicas, and the
    # busiest worker's step is the first stage's (it holds the larger half)
    replicated = step_cost(Pattern.PIPELINE, Cluster(4), link, work)
    first = pipeline_bytes(shape, 64, 1)[0] + 4 * shape.stage_params[0]
    assert replicated.comm_s == pytest.approx(first / link.bytes_per_s + (hops + 2) * 50e-6)
    split = _wide_shape("tensor")
    tensor = step_cost(Pattern.TENSOR, Cluster(2), link, dataclasses.replace(work, shape=split))
    assert split.split_compute == 1.0  # both pairs: every linear layer is split
    assert tensor.compute_s == pytest.approx(0.3)  # 1/2 of each layer on 2 x the rows: one worker's work
    sharded = step_cost(Pattern.FULL_SHARD, Cluster(2), link, work)
    assert sharded.comm_s == pytest.approx(1.5 * reduced.comm_s, rel=1e-3)  # 3 (N-1)/N M against 2 (N-1)/N M


def test_factors_price_the_rows_each_layer_sees_their_gather_and_the_gradients_rebuilt():
    shape = _wide_shape("allreduce")
    assert shape.linear_rows == (1.0, 1.0, 1.0, 1.0)
    params = sum(p.numel() for p in _wide_model().parameters())
    work = Workload(params, compute_s=0.3, batch=32, shape=shape)
    link = Link(1.0, shared=True)
    plain = step_cost(Pattern.RING_OVERLAPPED, Cluster(2), link, work)
    factored = step_cost(Pattern.RING_OVERLAPPED, Cluster(2), link, work, factors=True)
    gathered, taken = factor_bytes(shape, 32, 2)
    sent = gathered + 4 * (params - taken)  # what each worker sends: factors.json's 2.84 MB a step
    assert factored.comm_s == pytest.approx(2 * sent / link.bytes_per_s + 3 * 50e-6)
    assert factored.compute_s == pytest.approx(0.3 * (1 + taken / params / 3))  # each rebuilds both rows' sum
    assert factored.samples_per_s > 4 * plain.samples_per_s  # bench_factors measured 4.5x at 1 Gbit/s
    # to a server: the pushes carry the factors, the pulls the float32 weights
    served = step_cost(Pattern.STAR, Cluster(2), link, work, factors=True)
    assert served.comm_s < step_cost(Pattern.STAR, Cluster(2), link, work).comm_s
    # a sequence model: every position is a row of the layer's factors, so they stop paying
    torch.manual_seed(0)
    sequence = model_shape(
        nn.Sequential(nn.Linear(64, 64)),
        Batch({"x": torch.randn(2, 50, 64)}, torch.zeros(2, 50, 64)),
        SparkDLConfig().replace(num_workers=2),
        2,
    )
    assert sequence.linear_rows == (50.0,)
    assert factor_bytes(sequence, 32, 2) == (0.0, 0)  # 32 x 50 rows of 128 values > a 64 x 64 matrix


def test_model_parallel_layouts_the_shape_cannot_run_are_refused():
    work = Workload(1000, compute_s=0.1, batch=8)  # no cut, no split in the shape
    with pytest.raises(ValueError, match="a pipeline of 1 stages cannot run on 2 workers"):
        step_cost(Pattern.PIPELINE, Cluster(2), Link(1.0), work)
    with pytest.raises(ValueError, match="3 workers do not form tensor-parallel groups of 2"):
        step_cost(Pattern.TENSOR, Cluster(3), Link(1.0), dataclasses.replace(work, group=2))
