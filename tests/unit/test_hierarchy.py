"""Hierarchical aggregation: the grouping of ranks, and the settings it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sparkdl.comm.hierarchy import HierarchicalAllReduce, HostGroups, group_ranks, host_key
from sparkdl.config import Hierarchy, SparkDLConfig
from sparkdl.errors import CollectiveError, CollectiveTimeout, ConfigError
from sparkdl.strategies import check_settings

ADDRESSES = ["10.0.0.1:7001", "10.0.0.2:7001", "10.0.0.1:7002", "10.0.0.1:7001"]


def test_tasks_group_by_address_or_by_executor_in_order_of_their_first_rank():
    by_host = group_ranks([host_key(a, Hierarchy.HOST) for a in ADDRESSES])
    by_executor = group_ranks([host_key(a, Hierarchy.EXECUTOR) for a in ADDRESSES])
    assert by_host == [[0, 2, 3], [1]]  # two executors share 10.0.0.1
    assert by_executor == [[0, 3], [1], [2]]
    assert [g[0] for g in by_executor] == [0, 1, 2]  # the leaders: each group's smallest rank


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({"strategy": "fsdp"}, "fsdp"),
        ({"strategy": "allreduce", "compression": "1bit"}, "compression = '1bit'"),
        ({"strategy": "weight_averaging", "compression": "fp16"}, "compression = 'fp16'"),
        ({"strategy": "parameter_server", "backup_workers": 1, "num_workers": 4}, "backup_workers = 0"),
        ({"strategy": "weight_averaging", "wa_backup_workers": 1, "num_workers": 4}, "wa_backup_workers = 0"),
    ],
)
def test_a_hierarchy_refuses_what_it_cannot_combine_with(settings, refusal):
    with pytest.raises(ConfigError, match=refusal):
        check_settings(SparkDLConfig().replace(hierarchy="host", **settings))


def test_the_parameter_server_compresses_the_hosts_pushes():
    config = check_settings(
        SparkDLConfig().replace(hierarchy="executor", strategy="parameter_server", compression="1bit")
    )
    assert config.runtime.hierarchy is Hierarchy.EXECUTOR


class _Bucket:
    def __init__(self, tensor):
        self._tensor = tensor

    def buffer(self):
        return self._tensor


class _FailingHierarchy:
    def all_reduce(self, tensor):
        raise RuntimeError("leaders' group timed out")


class _SummingHierarchy:
    """Stands in for the three collectives: every one of 4 workers holds the same bucket."""

    def all_reduce(self, tensor):
        tensor.mul_(4)
        return 8


def test_the_hook_thread_answers_each_bucket_in_order_and_passes_a_failure_to_the_step():
    ok = HierarchicalAllReduce(_SummingHierarchy(), world_size=4)
    futures = [HierarchicalAllReduce.hook(ok, _Bucket(torch.full((3,), float(i)))) for i in range(5)]
    assert [f.wait().tolist() for f in futures] == [[float(i)] * 3 for i in range(5)]  # the mean
    assert ok.bytes_across_hosts == 5 * 8
    ok.close()
    assert not ok._thread.is_alive()

    failing = HierarchicalAllReduce(_FailingHierarchy(), world_size=2)
    future = HierarchicalAllReduce.hook(failing, _Bucket(torch.ones(2)))
    with pytest.raises(RuntimeError, match="leaders' group timed out"):
        future.wait()
    assert "leaders' group timed out" in str(failing.take_failure())  # typed, for the step to raise
    assert failing.take_failure() is None
    failing.close()
    assert not failing._thread.is_alive()


class _Shared:
    """A host's shared-memory level whose broadcast from the leader never comes."""

    def all_reduce_(self, tensor):
        pass

    def broadcast_(self, tensor):
        raise CollectiveTimeout(
            "shared-memory all-reduce: waited", setting="runtime.collective_timeout_s", limit_s=10.0
        )


def test_a_cut_between_hosts_is_named_by_the_leader_and_by_the_members_waiting_for_it(monkeypatch):
    def unreachable(tensor, group=None):
        raise RuntimeError("[gloo] Timed out waiting 10000ms for recv operation to complete")

    monkeypatch.setattr(dist, "all_reduce", unreachable)
    groups, addresses = [[0, 2], [1, 3]], ["10.77.0.2", "10.77.0.3"]
    leader = HostGroups(groups, 0, 0, None, object(), addresses, 10.0, _Shared())
    with pytest.raises(CollectiveError, match=r"rank 0 \(leader of host 10.77.0.2\) could not sum") as failed:
        leader.all_reduce(torch.ones(2))
    assert "rank 1 at 10.77.0.3" in str(failed.value) and "Timed out waiting" in str(failed.value)
    member = HostGroups(groups, 2, 0, None, None, addresses, 10.0, _Shared())
    with pytest.raises(CollectiveTimeout, match="rank 2 waited 10s for its host's leader, rank 0") as waited:
        member.all_reduce(torch.ones(2))
    assert waited.value.setting == "runtime.collective_timeout_s"
