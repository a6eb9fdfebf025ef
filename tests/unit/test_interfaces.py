"""The interface the process group binds: the setting, the environment's, else the one that
holds the executor's address (read from this machine's real interfaces)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from sparkdl.comm.network_interfaces import interface_addresses, interface_of
from sparkdl.worker.teardown import socket_interface

NAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def test_each_address_of_this_machine_maps_to_the_interface_that_holds_it():
    addresses = interface_addresses()
    assert str(addresses["lo"][0]) == "127.0.0.1"
    for name, held in addresses.items():
        for address in held:
            assert interface_of(str(address)) == name
    assert interface_of("localhost") == "lo"
    every = {str(a) for held in addresses.values() for a in held}
    assert interface_of("192.0.2.254") is None or "192.0.2.254" in every
    assert interface_of("::1") is None  # IPv4 only: gloo is then left to choose
    assert interface_of("no-such-host.invalid") is None


@pytest.fixture
def clean_environment(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)


def test_the_executors_address_chooses_the_interface_and_the_environment_comes_back(clean_environment):
    with socket_interface("", "127.0.0.1"):
        assert [os.environ.get(n) for n in NAMES] == ["lo", "lo"]
    assert [os.environ.get(n) for n in NAMES] == [None, None]
    # the host name resolves to loopback on many hosts: the executor's address decides, not it
    other = next((n for n, a in interface_addresses().items() if n != "lo"), None)
    if other is not None:
        with socket_interface("", str(interface_addresses()[other][0])):
            assert os.environ["GLOO_SOCKET_IFNAME"] == other


def test_the_setting_wins_then_the_environments_choice(clean_environment, monkeypatch):
    with socket_interface("eth7", "127.0.0.1"):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    with socket_interface("", "127.0.0.1"):  # the user's environment names gloo's: kept, NCCL's chosen
        assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0" and os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0" and "NCCL_SOCKET_IFNAME" not in os.environ
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib1")
    with socket_interface("", "127.0.0.1"):  # and the other way round
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo" and os.environ["NCCL_SOCKET_IFNAME"] == "ib1"


def test_an_address_no_interface_holds_leaves_torch_to_choose(clean_environment):
    unused = "203.0.113.77"  # TEST-NET-3: held by no interface here
    assert unused not in {str(a) for held in interface_addresses().values() for a in held}
    with socket_interface("", unused):
        assert [os.environ.get(n) for n in NAMES] == [None, None]
    assert socket.gethostbyname("localhost").startswith("127.")


_SECONDARY = """
import json, sys
from sparkdl.comm.network_interfaces import interface_addresses, interface_of
print(json.dumps([interface_of("10.200.0.2"), [str(a) for a in interface_addresses()["lo"]]]))
"""


@pytest.mark.skipif(
    shutil.which("unshare") is None or shutil.which("ip") is None, reason="needs unshare and ip"
)
def test_a_secondary_address_finds_its_interface():
    """In a private network namespace of its own (no traffic leaves it), loopback holds a
    first and a second address: the executor's on the second finds loopback (SIOCGIFADDR
    saw the first only, and torch was left to guess)."""
    setup = "ip link set lo up && ip addr add 10.200.0.1/24 dev lo && ip addr add 10.200.0.2/24 dev lo"
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", f"{setup} && {sys.executable} -c '{_SECONDARY}'"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        pytest.skip("unshare -n needs root (CAP_SYS_ADMIN)")
    assert done.returncode == 0, done.stderr
    interface, held = json.loads(done.stdout)
    assert interface == "lo"
    assert held == ["127.0.0.1", "10.200.0.1", "10.200.0.2"]
