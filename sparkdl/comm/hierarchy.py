"""Hierarchical aggregation: combine within a host first, then across hosts.

With several workers on one host (task slots or GPUs of one executor), a flat ring
all-reduce sends every worker's share over the network. MXNet's two-level parameter
server and Horovod's hierarchical all-reduce combine inside the host first: the host's
workers reduce into one leader (loopback, shared memory, NVLink), the leaders alone
exchange across hosts, and each leader hands the result back to its host. What crosses
the network per host is then one model's worth, whatever the workers per host:

    reduce to the leader (local group)  ->  all-reduce among leaders  ->  broadcast (local group)

``runtime.hierarchy`` says what a "host" is: ``host`` groups the tasks by address,
``executor`` by executor (``local-cluster`` runs several executors on one address; so
does a host running several executors). Every rank computes the same groups from
Spark's task infos, without a message; the groups' order is the order of their first
rank and a group's leader is its smallest rank.

The collectives here run on their own process groups: nothing else in sparkdl issues
collectives on them, so a thread of their own (:class:`HierarchicalAllReduce`'s) keeps
the order every rank issues them in. On CPUs (``runtime.shared_memory``) the host's level
goes through a shared-memory segment of its workers
(:class:`~sparkdl.comm.shared_memory.SharedMemoryGroup`) instead of the local gloo
group: the reduce becomes an all-reduce (every worker of the host gets the sum; the
leader's is the one that travels on) and the broadcast a copy out of the segment.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from sparkdl.comm.shared_memory import SharedMemoryGroup
from sparkdl.comm.traffic import ring_allreduce_bytes
from sparkdl.config import Hierarchy as HierarchyLevel
from sparkdl.errors import CollectiveError, CollectiveTimeout


def host_key(address: str, level: HierarchyLevel) -> str:
    """The key a task at ``address`` ("host:port", Spark's task info) is grouped by."""
    return address if level is HierarchyLevel.EXECUTOR else address.rsplit(":", 1)[0]


def group_ranks(keys: Sequence[str]) -> list[list[int]]:
    """Ranks with equal keys, each group in rank order, groups in order of their first rank."""
    groups: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


@dataclass
class HostGroups:
    """This rank's place in the two levels, and the process groups of each.

    Attributes:
        groups: every host's ranks (the same list on every rank).
        rank: this worker's global rank.
        host: the index of this rank's host (its group).
        local: the process group of this rank's host.
        leaders: the process group of the hosts' leaders (None on a rank that leads none).
        shared: the host's shared-memory group (None: the host's level goes through ``local``).
    """

    groups: list[list[int]]
    rank: int
    host: int
    local: dist.ProcessGroup
    leaders: dist.ProcessGroup | None
    addresses: list[str]  # each host's key (its address), by group
    timeout_s: float
    shared: SharedMemoryGroup | None = None

    @classmethod
    def build(cls, keys: Sequence[str], rank: int, timeout_s: float) -> HostGroups | None:
        """Form the groups (every rank calls this, in step); None where two levels would change
        nothing: one host, or one worker per host."""
        groups = group_ranks(keys)
        if len(groups) == 1 or len(groups) == len(keys):
            return None
        timeout = timedelta(seconds=timeout_s)
        local, _ = dist.new_subgroups_by_enumeration(groups, timeout=timeout)
        leaders = dist.new_group([g[0] for g in groups], timeout=timeout)
        host = next(i for i, g in enumerate(groups) if rank in g)
        addresses = [keys[g[0]] for g in groups]
        leading = leaders if groups[host][0] == rank else None
        return cls(groups, rank, host, local, leading, addresses, timeout_s)

    @property
    def hosts(self) -> int:
        return len(self.groups)

    @property
    def leader(self) -> int:
        """The global rank that leads this rank's host."""
        return self.groups[self.host][0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def members(self) -> int:
        """The other workers of this rank's host."""
        return len(self.groups[self.host]) - 1

    def share_memory(self, payload_bytes: int, timeout_s: float) -> SharedMemoryGroup | None:
        """Move the host's level into shared memory where its workers have it (collective over
        the host's workers); return the group, for the caller to close."""
        if self.members:
            self.shared = SharedMemoryGroup.form(
                self.groups[self.host], self.rank, self.local, payload_bytes, timeout_s
            )
        return self.shared

    def reduce_to_leader(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over this host's workers into its leader's copy (in shared memory:
        into every worker's)."""
        if self.shared is not None:
            self.shared.all_reduce_(tensor)
        else:
            dist.reduce(tensor, dst=self.leader, group=self.local)

    def broadcast_from_leader(self, tensor: torch.Tensor) -> None:
        if self.shared is not None:
            self.shared.broadcast_(tensor)
        else:
            dist.broadcast(tensor, src=self.leader, group=self.local)

    def all_reduce(self, tensor: torch.Tensor) -> int:
        """Sum ``tensor`` over every worker, in place; return the bytes this rank sent across
        hosts (a leader's share of the leaders' ring all-reduce; nothing on other ranks)."""
        self.reduce_to_leader(tensor)
        sent = 0
        if self.leaders is not None:
            try:
                dist.all_reduce(tensor, group=self.leaders)
            except RuntimeError as exc:  # gloo's timeout or a closed connection, as text
                raise self._across_failed(exc) from exc
            sent = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), self.hosts)
        try:
            self.broadcast_from_leader(tensor)
        except CollectiveTimeout as exc:
            raise self._leader_silent(exc) from exc
        return sent

    def _hosts_text(self) -> str:
        return ", ".join(
            f"rank {group[0]} at {address}"
            for group, address in zip(self.groups, self.addresses, strict=True)
        )

    def _across_failed(self, exc: RuntimeError) -> CollectiveError:
        return CollectiveError(
            f"rank {self.rank} (leader of host {self.addresses[self.host]}) could not sum with the other "
            f"hosts' leaders ({self._hosts_text()}) within runtime.collective_timeout_s = "
            f"{self.timeout_s:g}s: {exc}. "
            "A host that cannot be reached (a cut link, a host down, a firewall) stops the exchange "
            "across hosts; Spark re-runs the stage and the fit resumes from its last checkpoint"
        )

    def _leader_silent(self, exc: CollectiveTimeout) -> CollectiveTimeout:
        return CollectiveTimeout(
            f"rank {self.rank} waited {exc.limit_s or self.timeout_s:g}s for its host's leader, rank "
            f"{self.leader}, which was summing with the other hosts' leaders ({self._hosts_text()}) and "
            "never handed the result back: a host the leaders could not reach holds the exchange (the "
            "leader's own error names it); raise runtime.collective_timeout_s if one exchange can take "
            "that long",
            setting="runtime.collective_timeout_s",
            limit_s=exc.limit_s,
        )


def hierarchical_bytes(hierarchy: HostGroups, payload: int) -> int:
    """What one worker sends for one hierarchical all-reduce of ``payload`` bytes: a member its
    payload to the leader; a leader its share of the leaders' ring, and the result to each member."""
    if not hierarchy.is_leader:
        return payload
    return ring_allreduce_bytes(payload, hierarchy.hosts) + hierarchy.members * payload


class HierarchicalAllReduce:
    """A DDP communication hook: each bucket's gradients averaged by :meth:`HostGroups.all_reduce`.

    DDP calls the hook as buckets become ready, on every rank in the same order; one thread
    per worker runs the buckets' collectives in that order, so backward goes on computing
    the next buckets meanwhile (DDP waits for every bucket's future before the step).
    """

    def __init__(self, hierarchy: HostGroups, world_size: int) -> None:
        self.hierarchy = hierarchy
        self.world_size = world_size
        self.bytes_across_hosts = 0
        self.failure: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="sparkdl-hierarchy", daemon=True)
        self._thread.start()

    @staticmethod
    def hook(state, bucket):  # DDP refuses string annotations on a hook: set below
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        state._queue.put((bucket.buffer(), future))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            tensor, future = item
            try:
                tensor.div_(self.world_size)
                self.bytes_across_hosts += self.hierarchy.all_reduce(tensor)
                future.set_result(tensor)
            except BaseException as exc:  # the step fails on the caller's thread, with this error
                self.failure = exc  # DDP hands the caller its text only: take_failure() gives it back
                future.set_exception(exc)

    def take_failure(self) -> BaseException | None:
        """The error that failed a bucket's future since the last call (None: none did)."""
        failure, self.failure = self.failure, None
        return failure

    def close(self, timeout_s: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)


HierarchicalAllReduce.hook.__annotations__ = {
    "state": HierarchicalAllReduce,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
