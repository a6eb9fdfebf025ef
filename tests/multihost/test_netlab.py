"""Across separate hosts (issue 32): a standalone cluster of 2 worker hosts on a netlab
network, each with its own address, PID space and /dev/shm. Needs root and network
namespaces (``../shared/tools/netlab``); skipped with the reason where they are missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.spark.processes import ROOT


def find_netlab() -> Path:
    """``$NETLAB``, else ``netlab`` on the PATH, else the workplace's ``../shared/tools/netlab``."""
    named = os.environ.get("NETLAB") or shutil.which("netlab")
    return Path(named) if named else ROOT.parent / "shared" / "tools" / "netlab"


NETLAB = find_netlab()

pytestmark = pytest.mark.spark


def netlab_missing() -> str:
    if not NETLAB.exists():
        return f"needs netlab (the workplace's network lab): not at {NETLAB}; set NETLAB to its path"
    if os.geteuid() != 0:
        return "needs root, for network namespaces"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2 and unshare"
    return ""


@pytest.mark.skipif(bool(netlab_missing()), reason=netlab_missing() or "netlab available")
def test_every_rank_binds_its_hosts_address_by_itself_and_trains_the_reference_answer(tmp_path):
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "SPARK_LOCAL_IP"):
        env.pop(name, None)  # nothing names the interface: the worker must find it
    done = subprocess.run(
        [str(NETLAB), "--hosts", "3", "--rate", "1gbit", "--isolate", "--",
         sys.executable, str(ROOT / "tests/multihost/netlab_drill.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    hosts = result["hosts"]
    for name in ("allreduce host", "allreduce flat", "parameter_server sync"):
        run = result[name]
        assert run["max_abs_diff"] < 1e-5, (name, run)
        executors = {device["host"] for device in run["devices"]}
        assert executors == {hosts[1], hosts[2]}, run["devices"]  # two workers on each worker host
    # with the hierarchy, the two ranks of a host sum in its shared memory, and only the
    # hosts' leaders cross the switch
    assert {d["exchange"] for d in result["allreduce host"]["devices"]} == {"shared_memory+gloo"}
    across = result["allreduce host"]["across"]
    assert sum(1 for b in across if b > 0) == 2, across
