"""Which network interface holds an address: the one gloo and NCCL must bind.

gloo, left alone, takes its address from the host name, which a stock Debian or Ubuntu
host resolves to loopback (``127.0.1.1`` in ``/etc/hosts``): ranks on other hosts then
cannot connect, and the process group fails only after the collective timeout. Spark
already knows each executor's real address (the barrier task infos), so the worker
binds the interface that holds it. Every IPv4 address of every interface counts, the
secondary ones too (an executor bound to an address added beside the interface's first:
``getifaddrs``, through psutil).
"""

from __future__ import annotations

import ipaddress
import socket

import psutil


def interface_of(host: str) -> str | None:
    """The name of the interface that holds ``host``'s IPv4 address (a name is resolved
    first); None where none does, the address is not IPv4, or the system cannot say."""
    try:
        address = ipaddress.IPv4Address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    for name, values in interface_addresses().items():
        if address in values:
            return name
    return None


def interface_addresses() -> dict[str, list[ipaddress.IPv4Address]]:
    """Every interface with an IPv4 address, by name, with each of its addresses (the
    first first; empty where the system cannot say)."""
    try:
        found = psutil.net_if_addrs()
    except OSError:
        return {}
    return {
        name: [ipaddress.IPv4Address(a.address) for a in entries if a.family == socket.AF_INET]
        for name, entries in found.items()
        if any(a.family == socket.AF_INET for a in entries)
    }
