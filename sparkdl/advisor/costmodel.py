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
  optimizer state it averages) divided by ``tau``;
- compression divides ``M`` by its factor; 1-bit and top-k travel by all-gather, each
  worker sending its payload to the ``N - 1`` others.

DDP overlaps the all-reduce with backward (about two thirds of a step's compute): its
step is ``compute + communication - OVERLAP * min(backward, communication)``, with the
overlap fitted on measured runs; weight averaging and the parameter server communicate
after the step, so theirs is ``compute + communication``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkdl.comm.traffic import Pattern

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
class Workload:
    """One worker's step: ``compute_s`` of forward, backward and optimizer on its batch.

    ``state_copies``: optimizer tensors per parameter that weight averaging averages too
    (SGD with momentum 1, Adam 2; 0 without ``average_optimizer_state``).
    """

    params: int
    compute_s: float
    batch: int
    state_copies: int = 0

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


def step_cost(
    pattern: Pattern,
    cluster: Cluster,
    link: Link,
    workload: Workload,
    *,
    hierarchical: bool = False,
    compression: str = "none",
    tau: int = 1,
) -> StepCost:
    """The predicted step of a strategy exchanging by ``pattern`` (periodic: the mean step over ``tau``)."""
    payload = workload.model_bytes
    if pattern is Pattern.RING_PERIODIC:
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
    elif pattern is Pattern.RING_PERIODIC:
        comm /= tau
        step = compute + comm
    else:
        step = compute + comm
    return StepCost(cluster.workers, compute, comm, step, cluster.workers * workload.batch / step)
