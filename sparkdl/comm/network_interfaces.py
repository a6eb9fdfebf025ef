"""Which network interface holds an address: the one gloo and NCCL must bind.

gloo, left alone, takes its address from the host name, which a stock Debian or Ubuntu
host resolves to loopback (``127.0.1.1`` in ``/etc/hosts``): ranks on other hosts then
cannot connect, and the process group fails only after the collective timeout. Spark
already knows each executor's real address (the barrier task infos), so the worker
binds the interface that holds it (Linux: ``SIOCGIFADDR`` on each interface; IPv4).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_IFREQ = struct.Struct("16s16s")


def interface_of(host: str) -> str | None:
    """The name of the interface that holds ``host``'s IPv4 address (a name is resolved
    first); None where none does, the address is not IPv4, or the system cannot say."""
    try:
        address = ipaddress.IPv4Address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    for name, value in interface_addresses().items():
        if value == address:
            return name
    return None


def interface_addresses() -> dict[str, ipaddress.IPv4Address]:
    """Every interface with an IPv4 address, by name (empty where the system has no
    ``SIOCGIFADDR``, as on macOS)."""
    found: dict[str, ipaddress.IPv4Address] = {}
    try:
        names = [name for _, name in socket.if_nameindex()]
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return found
    with probe:
        for name in names:
            try:
                request = _IFREQ.pack(name.encode()[:15], b"")
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # down, or no IPv4 address
                continue
            found[name] = ipaddress.IPv4Address(reply[20:24])
    return found
