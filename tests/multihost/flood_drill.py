"""A stranger host floods a driver port while the executors on two other hosts connect to it
(issue 53's reserved places, across hosts).

Run from netlab_drill.py, on host 0 of a 4-host netlab whose hosts 1 and 2 carry the Spark
cluster's executors: a listener on the driver's address, of the driver's own kind (32
handshake places, an ACK to every HELLO), takes Spark's live view of the executors'
addresses as its ``known`` (:func:`sparkdl.spark.cluster.executor_addresses`). Host 3, the
stranger, takes eight addresses and holds 64 connections from each that never send a byte,
renewed as the listener closes them; the grace and the HELLO timeout are set past the drill,
so that no place the flood holds is ever evictable (the flood that outpaces the grace, which
the least-progress eviction alone cannot beat). Then a Spark job's tasks, on the executors of
hosts 1 and 2, each open three handshakes with the workers' own client and retry: with the
executors' addresses known every one gets in at its first try; without (``known = None``),
none does within its deadline.

    netlab exec 3 -- python tests/multihost/flood_drill.py HOST PORT SECONDS ADDRESS...
        # the flooder: hold connections from each ADDRESS (added to host 3's eth0) for SECONDS
"""

from __future__ import annotations

import json
import logging
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

STRANGER = 3  # the flooding host
PER_ADDRESS = 64  # connections the flooder holds from each of its addresses
HANDSHAKES_PER_TASK = 3
SECRET = b"n" * 32


def stranger_addresses(hosts: list[str]) -> list[str]:
    """Eight addresses for host 3, in the lab's /24 beside the hosts' own."""
    prefix = hosts[STRANGER].rsplit(".", 1)[0]
    return [f"{prefix}.{100 + i}" for i in range(8)]


def flood_from_a_stranger(spark: Any, hosts: list[str], out: Path) -> dict[str, Any]:
    """The listener with the executors known, then without; each under the stranger's flood."""
    from sparkdl.spark.cluster import executor_addresses
    from sparkdl.wire import listener as listener_module

    addresses = stranger_addresses(hosts)
    for address in addresses:  # the stranger's other addresses, on its own cable
        subprocess.run(
            ["netlab", "exec", str(STRANGER), "--", "ip", "addr", "add", f"{address}/24", "dev", "eth0"],
            check=True,
            timeout=30,
        )
    grace = listener_module.GRACE_S
    listener_module.GRACE_S = 600.0  # no place the flood holds ever becomes evictable
    try:
        known = executor_addresses(spark)
        return {
            "known": sorted(a for a in (*hosts, *addresses) if known is not None and a in known),
            "executors known": _flooded_handshakes(spark, hosts, addresses, known, out, deadline_s=20.0),
            "no address known": _flooded_handshakes(spark, hosts, addresses, None, out, deadline_s=3.0),
        }
    finally:
        listener_module.GRACE_S = grace


def _flooded_handshakes(
    spark: Any, hosts: list[str], addresses: list[str], known: Any, out: Path, deadline_s: float
) -> dict[str, Any]:
    from sparkdl.services.ps.protocol import PS_WIRE, Frame, Kind
    from sparkdl.wire.listener import ConnectionListener

    served: list[tuple[int, str]] = []
    listener = ConnectionListener(
        hosts[0], PS_WIRE, SECRET,
        lambda hello, channel, peer: (served.append((hello.rank, peer[0])), channel.send(Frame(Kind.ACK))),
        "netlab-flood", logging.getLogger("flood"), max_pending=32, hello_timeout_s=600.0, known=known,
    )  # fmt: skip
    log = (out / f"flooder-{known is not None}.log").open("wb")
    flooder = subprocess.Popen(
        ["netlab", "exec", str(STRANGER), "--", sys.executable, __file__,
         listener.host, str(listener.port), "90", *addresses],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        full = 32 - 8 if known is not None else 32  # the strangers' share of the places
        deadline = time.monotonic() + 60
        while listener.pending < full and time.monotonic() < deadline and flooder.poll() is None:
            time.sleep(0.05)
        held_before = listener.pending
        host, port, key = listener.host, listener.port, listener.public_key
        tried = (
            spark.sparkContext.parallelize(range(4), 4)
            .mapPartitionsWithIndex(
                lambda task, _: _handshakes(task, host, port, key, deadline_s), preservesPartitioning=True
            )
            .collect()
        )
        flooding = flooder.poll() is None  # the flood lasted through every handshake
        return {
            "held_before": held_before,
            "flooding": flooding,
            "tries": tried,
            "served": sorted(served),
            "refusals": dict(listener.refusals.counts),
        }
    finally:
        flooder.kill()  # netlab exec's process: the flooder's namespace goes with it
        flooder.wait(30)
        log.close()
        listener.stop()


def _handshakes(task: int, host: str, port: int, key: bytes, deadline_s: float):
    """On an executor: HANDSHAKES_PER_TASK handshakes with the workers' client and retries;
    per handshake its rank, this executor's address, its tries, seconds and error."""
    from sparkdl.services.ps.protocol import Kind, client_hello
    from sparkdl.wire.handshake import with_retries

    for i in range(HANDSHAKES_PER_TASK):
        rank, tries, started = task * HANDSHAKES_PER_TASK + i, [], time.monotonic()

        def handshake(rank: int = rank, tries: list[str] = tries) -> None:
            with socket.create_connection((host, port), timeout=5) as sock:
                tries.append(sock.getsockname()[0])  # the address it connected from
                channel = client_hello(sock, SECRET, rank=rank, attempt=0, server_key=key)
                assert channel.recv(1 << 20).kind is Kind.ACK

        error = ""
        try:
            with_retries(handshake, f"rank {rank}", deadline_s=deadline_s)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        seconds = time.monotonic() - started
        address = tries[-1] if tries else ""
        yield {"rank": rank, "address": address, "tries": len(tries), "seconds": seconds, "error": error}


def hold(host: str, port: int, seconds: float, sources: list[str]) -> None:
    """The flooder: PER_ADDRESS connections from each of ``sources`` that never send a byte,
    each renewed when the listener closes it or turns it away, for ``seconds``; bounded: at
    most 8 renewals per 50 ms and 20,000 connections opened in all."""
    from sparkdl.wire.socket_io import BUSY

    held: dict[socket.socket, str] = {}
    short = {source: PER_ADDRESS for source in sources}  # connections each source lacks
    opened = 0

    def open_one(source: str) -> None:
        nonlocal opened
        opened += 1
        try:
            sock = socket.create_connection((host, port), timeout=2, source_address=(source, 0))
        except OSError:
            return
        sock.setblocking(False)
        held[sock] = source
        short[source] -= 1

    end = time.monotonic() + seconds
    for source in sources:
        for _ in range(PER_ADDRESS):
            open_one(source)
    while time.monotonic() < end and opened < 20_000:
        for source in [s for s, n in short.items() for _ in range(n)][:8]:
            open_one(source)
        readable, _, _ = select.select(list(held), [], [], 0.05)
        for sock in readable:
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            if not data or data.endswith(BUSY):  # closed, or turned away: renew it
                short[held.pop(sock)] += 1
                sock.close()
    print(json.dumps({"opened": opened, "held": len(held)}), flush=True)
    for sock in held:
        sock.close()


if __name__ == "__main__":
    hold(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:])
