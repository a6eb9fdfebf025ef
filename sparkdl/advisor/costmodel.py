"""What a step costs: compute plus communication, by strategy, on a link of given speed.

Pure arithmetic (no Spark, no torch): the alpha-beta model of each shape of exchange a
strategy declares (:class:`sparkdl.comm.traffic.Pattern`, ``SyncStrategy.pattern``),
used to project sparkdl beyond the machines it was measured on
(docs/benchmarks/history.md, "Scaling on paper") and meant as the core of the advisor.

A link has a latency ``alpha`` per message and a bandwidth ``B`` per host, full duplex
(a host sends and receives at ``B`` at once). For a model of ``M`` bytes on ``N``
workers, ``L`` per host (``H = N / L`` hosts):

- ring all-reduce: ``2 (N-1)`` messages, each worker sends ``2 (N-1)/N * M``; with
  ``L`` workers per host sharing its NIC flat, the host sends ``L`` times that;
- hierarchical (:mod:`sparkdl.comm.hierarchy`): the hosts' leaders run the ring,
  ``2 (H-1)/H * M`` per host, and the host's own reduce and broadcast stay local;
- parameter server (one server host): it receives every pusher's ``M`` and sends every
  puller ``M`` per step, ``P * M`` each way through its NIC, ``P = N`` flat or ``H``
  with a hierarchy; compression shrinks the pushes only (pulls are float32), so on a
  full-duplex NIC it leaves the server's busiest direction as it was;
- weight averaging every ``tau`` steps: the all-reduce of the weights (and of the
  optimizer state it averages) divided by ``tau``; streaming it in ``F`` fragments sends
  ``F`` all-reduces of ``M / F`` per ``tau`` steps (the state at epoch ends only), each
  overlapping ``delay`` steps of compute as DDP's does its backward;
- compression divides ``M`` by its factor; 1-bit and top-k travel by all-gather, each
  worker sending its payload to the ``N - 1`` others;
- sufficient factors (``auto``): a fully connected ``m x n`` layer whose ``B (m + n)`` rows
  cost less round a ring all-gather than its matrix round the all-reduce
  (:func:`~sparkdl.comm.traffic.factors_pay`) sends ``(N-1) B (m + n)`` values after
  backward, and leaves the all-reduce;
- fsdp: the parameters all-gathered twice and the gradients reduce-scattered,
  ``3 (N-1)/N * M`` per worker, overlapped with compute as DDP's is;
- a pipeline of ``p`` stages (``r = N / p`` replicas, ``m`` micro-batches): a step moves the
  ``p B`` rows of its pipeline through every cut, activations forward and their gradients
  back, ``p B (a_s + a_{s-1})`` bytes from stage ``s`` (``a`` the bytes per row at each cut),
  plus the rows' inputs to the first stage and labels to the last; the replicas all-reduce
  each stage's gradients. Its compute has GPipe's bubble: ``(m + p - 1) / m`` of a balanced
  stage's;
- full-batch L-BFGS (``optimizer = "lbfgs"``): a pass is a step of ``k`` batches whose
  exchange (a ring, or a server's star) follows the pass, plus its algebra
  (:func:`sparkdl.advisor.full_batch.full_batch_pass`);
- tensor parallelism in groups of ``t``: every worker of a group runs the group's ``t B``
  rows, the split layers' ``1/t`` slices of them and the rest whole, and all-reduces each
  split pair's output and input gradient, ``2 (t-1)/t * t B * s`` bytes (``s`` per row); the
  rows are all-gathered first, and the groups all-reduce the gradients.

Model parallelism sends activations, data parallelism weights: which is less depends on the
model's widths against the batch (:class:`ModelShape`), so the cost model reads both.

DDP overlaps the all-reduce with backward (about two thirds of a step's compute): its
step is ``compute + communication - OVERLAP * min(backward, communication)``, with the
overlap fitted on measured runs; weight averaging and the parameter server communicate
after the step, so theirs is ``compute + communication``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from sparkdl.comm.traffic import Pattern, factors_pay, fewer_values

BACKWARD_SHARE = 2 / 3  # of a step's compute: what DDP's bucketed all-reduce overlaps with
#: The share of the shorter of backward and communication that DDP hides behind the other:
#: 0.35 and 0.39 fitted on this machine's 1 Gbit/s runs (float32 and fp16 all-reduce, gloo
#: on 2 cores, where communication competes with compute for the cores); 1 = perfect overlap.
OVERLAP = 0.4

#: Bytes sent per float32 byte by each compression (1bit: signs + two float32 means per 1,024
#: values; topk at 1%: (int32 index, float32 value) pairs).
COMPRESSION_FACTOR = {"none": 1.0, "fp16": 0.5, "bf16": 0.5, "1bit": 1 / 30, "topk": 0.02}


@dataclass(frozen=True)
class Link:
    """A host's network: ``gbit_s`` each way at once, ``latency_s`` per message.

    ``shared``: one link carries every worker's bytes, both directions (``slow-net`` on a
    single machine: its loopback is the rate-limited link).
    """

    gbit_s: float
    latency_s: float = 50e-6
    shared: bool = False

    @property
    def bytes_per_s(self) -> float:
        return self.gbit_s * 1e9 / 8


@dataclass(frozen=True)
class ModelShape:
    """What model parallelism and sufficient factors send, read off the model and a batch
    (:func:`sparkdl.advisor.shape.model_shape`); bytes per row in the dtypes the rows had.

    Attributes:
        linears: (inputs, outputs) of each fully connected layer whose weight gradient may
            travel as sufficient factors (float32); linear_rows: the rows each of them
            sees per row of the batch (a sequence's positions, every call; empty: 1 each).
        cut_bytes: per row, what crosses each cut between consecutive pipeline stages
            (``stages - 1`` of them); stage_params: each stage's parameters.
        split_bytes: per row, what a tensor-parallel group all-reduces in a step: each split
            layer's partial output (forward) or input gradient (backward);
            split_collectives: how many all-reduces that is; split_params: the parameters
            the split layers shard (each worker holds ``1/t`` of them; a rows layer's bias
            stays whole); split_compute: their share of the model's fully connected work.
        input_bytes, label_bytes: one row's inputs and label.
    """

    linears: tuple[tuple[int, int], ...] = ()
    linear_rows: tuple[float, ...] = ()
    cut_bytes: tuple[float, ...] = ()
    stage_params: tuple[int, ...] = ()
    split_bytes: float = 0.0
    split_collectives: int = 0
    split_params: int = 0
    split_compute: float = 0.0
    input_bytes: float = 0.0
    label_bytes: float = 0.0

    @property
    def stages(self) -> int:
        return len(self.cut_bytes) + 1


@dataclass(frozen=True)
class Workload:
    """One worker's step: ``compute_s`` of forward, backward and optimizer on its batch.

    ``state_copies``: optimizer tensors per parameter that weight averaging averages too
    (SGD with momentum 1, Adam 2; 0 without ``average_optimizer_state``).
    ``shape``: the widths model parallelism and sufficient factors send;
    ``microbatches``: a pipeline's per step; ``group``: the tensor-parallel group's size
    (0: every worker); ``accumulate``: micro-batches per step (``batch`` counts all their
    rows), which fsdp and tensor parallelism exchange one by one.
    """

    params: int
    compute_s: float
    batch: int
    state_copies: int = 0
    shape: ModelShape = field(default_factory=ModelShape)
    microbatches: int = 1
    group: int = 0
    accumulate: int = 1

    @property
    def model_bytes(self) -> float:
        return 4.0 * self.params


@dataclass(frozen=True)
class Cluster:
    workers: int
    per_host: int = 1

    def __post_init__(self) -> None:
        if self.workers < 1 or self.per_host < 1 or self.workers % self.per_host:
            raise ValueError(
                f"{self.workers} workers cannot be spread {self.per_host} per host: the workers must "
                "be a positive multiple of the workers per host"
            )

    @property
    def hosts(self) -> int:
        return self.workers // self.per_host


@dataclass(frozen=True)
class StepCost:
    workers: int
    compute_s: float
    comm_s: float
    step_s: float
    samples_per_s: float

    @property
    def efficiency(self) -> float:
        """Samples/s over N times one worker's without communication."""
        return self.compute_s / self.step_s

    @property
    def speedup(self) -> float:
        """Samples/s over one worker's without communication."""
        return self.efficiency * self.workers


def host_bytes(
    pattern: Pattern,
    cluster: Cluster,
    model_bytes: float,
    *,
    hierarchical: bool,
    compression: str = "none",
) -> float:
    """Bytes the busiest host sends per exchange: the server's for a parameter server; for
    a ring, one host's outgoing edge (ranks of a host consecutive in the ring, as the
    hierarchy's groups and NCCL's rings arrange them)."""
    m = model_bytes * COMPRESSION_FACTOR[compression]
    ring = cluster.hosts if hierarchical else cluster.workers  # the ring's members, or the pushers
    if pattern is Pattern.STAR:  # float32 pulls (the default) fill the server's NIC
        return ring * model_bytes
    if ring == 1:
        return 0.0
    if compression in ("1bit", "topk"):  # all-gather: every payload reaches every other ring member
        return (ring - 1) * m
    return 2 * (ring - 1) / ring * m


def shared_bytes(pattern: Pattern, cluster: Cluster, model_bytes: float, compression: str = "none") -> float:
    """Bytes of one exchange when a single link carries every worker's traffic both ways."""
    m = model_bytes * COMPRESSION_FACTOR[compression]
    n = cluster.workers
    if pattern is Pattern.STAR:
        return n * (m + model_bytes)  # every push (compressed) and every pull (float32)
    if compression in ("1bit", "topk"):
        return n * (n - 1) * m
    return n * 2 * (n - 1) / n * m


def messages(pattern: Pattern, cluster: Cluster, *, hierarchical: bool) -> int:
    """Sequential messages of one exchange (each costs the link's latency)."""
    ring = cluster.hosts if hierarchical else cluster.workers
    if pattern is Pattern.STAR:
        return 2
    return 2 * (ring - 1)


def ring_share(members: int) -> float:
    """The share of a payload one member of a ring all-reduce sends: ``2 (n-1)/n``."""
    return 2 * (members - 1) / members if members > 1 else 0.0


def _layer_rows(shape: ModelShape, rows: int) -> Iterator[tuple[int, int, int]]:
    """(inputs, outputs, rows it sees) of each fully connected layer, for ``rows`` batch rows."""
    per_row = shape.linear_rows or (1.0,) * len(shape.linears)
    for (inputs, outputs), each in zip(shape.linears, per_row, strict=True):
        yield inputs, outputs, round(rows * each)


def factor_bytes(shape: ModelShape, rows: int, workers: int) -> tuple[float, int]:
    """With sufficient factors ``auto``: the bytes one worker's factors send round the ring
    all-gather, and the parameters they take out of the all-reduce (the layers they pay for,
    each with the rows it sees: ``rows`` times its :attr:`ModelShape.linear_rows`)."""
    sent, taken = 0.0, 0
    for inputs, outputs, seen in _layer_rows(shape, rows):
        if factors_pay(seen, inputs, outputs, workers):
            sent += 4.0 * (workers - 1) * seen * (inputs + outputs)
            taken += inputs * outputs
    return sent, taken


def full_shard_bytes(model_bytes: float, workers: int, accumulate: int = 1) -> float:
    """Bytes one fsdp worker sends in a step: the parameters all-gathered twice (forward,
    backward) and the gradients reduce-scattered, ``3 (N-1)/N`` of the model, per micro-batch."""
    return 1.5 * ring_share(workers) * model_bytes * accumulate


def pipeline_bytes(shape: ModelShape, rows: int, replicas: int) -> list[float]:
    """Bytes each stage's worker sends in a step, ``rows`` of its own: its pipeline's
    ``stages x rows`` activations over its cuts (forward out, gradients back), its rows'
    inputs to the first stage and labels to the last, and its stage's all-reduce over the
    ``replicas``."""
    p = shape.stages
    whole = p * rows
    sent = []
    for s in range(p):
        out = ring_share(replicas) * 4.0 * shape.stage_params[s]
        if s < p - 1:
            out += whole * shape.cut_bytes[s] + rows * shape.label_bytes
        if s > 0:
            out += whole * shape.cut_bytes[s - 1] + rows * shape.input_bytes
        sent.append(out)
    return sent


def tensor_bytes(shape: ModelShape, params: int, rows: int, group: int, replicas: int) -> float:
    """Bytes one worker of a tensor-parallel group of ``group`` sends in a step, ``rows`` of its
    own: the split layers' all-reduces over the group's rows, the rows' all-gather, and the
    all-reduce of what it holds over the ``replicas``."""
    held = params - shape.split_params * (group - 1) / group
    return (
        ring_share(group) * group * rows * shape.split_bytes
        + (group - 1) * rows * (shape.input_bytes + shape.label_bytes)
        + ring_share(replicas) * 4.0 * held
    )


def step_cost(
    pattern: Pattern,
    cluster: Cluster,
    link: Link,
    workload: Workload,
    *,
    hierarchical: bool = False,
    compression: str = "none",
    tau: int = 1,
    factors: bool = False,
    fragments: int = 1,
    delay: int = 0,
) -> StepCost:
    """The predicted step of a strategy exchanging by ``pattern`` (periodic: the mean step over
    ``tau``, in ``fragments`` whose sums travel ``delay`` steps; ``factors``: sufficient
    factors ``auto`` on a ring or star)."""
    if pattern in (Pattern.FULL_SHARD, Pattern.PIPELINE, Pattern.TENSOR):
        return _model_split_cost(pattern, cluster, link, workload)
    if factors and pattern in (Pattern.RING_OVERLAPPED, Pattern.STAR) and cluster.workers > 1:
        return _factored_cost(pattern, cluster, link, workload)
    payload = workload.model_bytes
    streaming = pattern is Pattern.RING_PERIODIC and fragments > 1
    if streaming:
        payload /= fragments  # one fragment's weights; the state waits for the epoch's end
    elif pattern is Pattern.RING_PERIODIC:
        payload *= 1 + workload.state_copies
    if link.shared:
        sent = shared_bytes(pattern, cluster, payload, compression)
    else:
        sent = host_bytes(pattern, cluster, payload, hierarchical=hierarchical, compression=compression)
    comm = messages(pattern, cluster, hierarchical=hierarchical) * link.latency_s + sent / link.bytes_per_s
    if cluster.workers == 1:
        comm = 0.0
    compute = workload.compute_s
    if pattern is Pattern.RING_OVERLAPPED:
        backward = compute * BACKWARD_SHARE
        step = compute + comm - OVERLAP * min(backward, comm)
    elif streaming:  # F fragments per tau steps, each hidden in part behind delay steps
        exposed = comm - OVERLAP * min(delay * compute, comm)
        comm, step = fragments * comm / tau, compute + fragments * exposed / tau
    elif pattern is Pattern.RING_PERIODIC:
        comm /= tau
        step = compute + comm
    else:
        step = compute + comm
    return StepCost(cluster.workers, compute, comm, step, cluster.workers * workload.batch / step)


def _factored_cost(pattern: Pattern, cluster: Cluster, link: Link, workload: Workload) -> StepCost:
    """Sufficient factors ``auto``: on a ring, the layers they pay for gathered after backward
    and the rest all-reduced in DDP's buckets; to a server, the pushes carry the factors (the
    pulls stay float32 weights). Where they pay for no layer, the plain exchange's cost."""
    n, rows, compute = cluster.workers, workload.batch, workload.compute_s
    if pattern is Pattern.STAR:
        push = 4.0 * workload.params
        for inputs, outputs, seen in _layer_rows(workload.shape, rows):
            if fewer_values(seen, inputs, outputs):
                push -= 4.0 * (inputs * outputs - seen * (inputs + outputs))
        sent = n * (push + workload.model_bytes) if link.shared else n * workload.model_bytes
        comm = 2 * link.latency_s + sent / link.bytes_per_s
        step = compute + comm
        return StepCost(n, compute, comm, step, n * rows / step)
    gathered, taken = factor_bytes(workload.shape, rows, n)
    if not taken:
        return step_cost(pattern, cluster, link, workload)
    # every worker rebuilds the taken layers' gradient from all N workers' rows: N times its own
    # weight-gradient work (a third of a fully connected layer's step) on those layers
    compute += (n - 1) * workload.compute_s * (taken / workload.params) / 3
    rest = ring_share(n) * 4.0 * (workload.params - taken)
    spread = n if link.shared else 1  # a ring: one edge leaves each host
    bucket_s = 2 * (n - 1) * link.latency_s + spread * rest / link.bytes_per_s  # overlaps with backward
    factor_s = (n - 1) * link.latency_s + spread * gathered / link.bytes_per_s  # after backward
    comm = bucket_s + factor_s
    step = compute + factor_s + bucket_s - OVERLAP * min(compute * BACKWARD_SHARE, bucket_s)
    return StepCost(n, compute, comm, step, n * rows / step)


def _model_split_cost(pattern: Pattern, cluster: Cluster, link: Link, workload: Workload) -> StepCost:
    """fsdp, a pipeline and tensor parallelism: bytes per worker from the model's shape; the
    busiest worker's, or all of them on a shared link. Priced for one worker per host (the
    projections' layout): with more, ``per_host`` multiplies a pipeline's or a group's busiest
    worker's bytes, an upper bound (a host's own stages or group talk inside it); fsdp's ring
    sends one worker's bytes out of each host.

    Raises:
        ValueError: a pipeline without a cut in the shape, or workers that are no multiple of
            its stages or of the tensor-parallel group.
    """
    n, shape, compute = cluster.workers, workload.shape, workload.compute_s
    if pattern is Pattern.PIPELINE and (not shape.cut_bytes or n % shape.stages):
        raise ValueError(
            f"a pipeline of {shape.stages} stages cannot run on {n} workers (the shape has "
            f"{len(shape.cut_bytes)} cuts): give a model shape with a cut and a multiple of its stages"
        )
    if pattern is Pattern.TENSOR and n % (workload.group or n):
        raise ValueError(f"{n} workers do not form tensor-parallel groups of {workload.group}")
    if n == 1:
        return StepCost(1, compute, 0.0, compute, workload.batch / compute)
    if pattern is Pattern.FULL_SHARD:  # every micro-batch gathers and reduce-scatters again
        each = [full_shard_bytes(workload.model_bytes, n, workload.accumulate)] * n
        hops = 3 * (n - 1) * workload.accumulate
    elif pattern is Pattern.PIPELINE:
        p, m = shape.stages, workload.microbatches
        replicas = n // p
        each = pipeline_bytes(shape, workload.batch, replicas) * replicas
        hops = 2 * m * (p - 1) + 2 * (replicas - 1)
        compute *= (m + p - 1) / m  # the bubble: each stage idles (p - 1) of m + p - 1 slots
    else:
        t = workload.group or n
        replicas = n // t
        each = [tensor_bytes(shape, workload.params, workload.batch, t, replicas)] * n
        per_batch = 2 * (t - 1) * shape.split_collectives + 2 * (t - 1)  # its sums, its rows' gather
        hops = per_batch * workload.accumulate + 2 * (replicas - 1)
        split = shape.split_compute
        compute *= split + (1 - split) * t  # 1/t of the split layers, the rest on t x the rows
    if link.shared:
        sent = sum(each)
    else:
        sent = max(each) * (1 if pattern is Pattern.FULL_SHARD else cluster.per_host)  # a ring: one edge out
    comm = hops * link.latency_s + sent / link.bytes_per_s
    step = compute + comm
    if pattern is Pattern.FULL_SHARD:  # gathers prefetched behind forward and backward
        step -= OVERLAP * min(compute, comm)
    return StepCost(n, compute, comm, step, n * workload.batch / step)
