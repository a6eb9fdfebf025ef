"""The executors' addresses the driver's listeners reserve places for: read from Spark
(here a stand-in for its status store), resolved, and refreshed on a miss without waiting."""

from __future__ import annotations

import time

from sparkdl.spark import cluster


class Context:
    """What ExecutorAddresses reads of a SparkContext: its conf."""

    def __init__(self, driver_host):
        self._conf = {"spark.driver.host": driver_host}

    def getConf(self):  # SparkContext's name
        return self._conf


def test_a_new_executors_address_is_known_soon_after_its_first_miss_and_a_lookup_never_waits(monkeypatch):
    hosts = {"10.1.2.3"}
    reads = []

    def executor_hosts(sc):
        reads.append(time.monotonic())
        time.sleep(0.2)  # a slow status store: lookups must not wait for it
        return set(hosts)

    monkeypatch.setattr(cluster, "executor_hosts", executor_hosts)
    monkeypatch.setattr(cluster.ExecutorAddresses, "REFRESH_S", 0.5)
    context = Context("10.9.9.9")
    known = cluster.ExecutorAddresses(lambda: context)
    known.refresh()
    assert "10.1.2.3" in known and "10.9.9.9" in known  # the executors' and the driver's own
    assert "10.1.2.4" not in known and len(reads) == 1  # read once; a miss this soon reads nothing
    hosts.add("10.1.2.4")  # dynamic allocation adds an executor
    time.sleep(0.6)
    started = time.monotonic()
    assert "10.1.2.4" not in known  # the miss starts a reading and answers at once
    assert time.monotonic() - started < 0.1
    deadline = time.monotonic() + 5
    while "10.1.2.4" not in known and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "10.1.2.4" in known and len(reads) == 2
    for _ in range(200):  # a flood of misses within REFRESH_S of the reading reads nothing more
        assert "192.0.2.1" not in known
    assert len(reads) == 2
    time.sleep(0.6)
    for _ in range(200):  # past it: the first miss starts one reading, the rest none
        assert "192.0.2.1" not in known
    time.sleep(0.3)
    assert len(reads) == 3


def test_with_no_context_nothing_is_known_and_a_new_context_is_read():
    """The weights server outlives a SparkContext: the view reads whichever is active."""
    active = [None]
    known = cluster.ExecutorAddresses(lambda: active[0])
    known.refresh()
    assert "127.0.0.1" not in known
    active[0] = Context("127.0.0.1")
    known.refresh()
    assert "127.0.0.1" in known


def test_a_loopback_driver_knows_loopbacks_addresses():
    assert cluster._resolved({"127.0.1.1"}) >= {"127.0.1.1", "127.0.0.1", "::1"}
    assert "127.0.0.1" not in cluster._resolved({"10.1.2.3"})
