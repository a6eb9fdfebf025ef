"""The authenticated framing alone (``sparkdl.wire.framing``): echo round trips per second of
one frame each way, against a bare loopback socket echoing the same bytes, in one run; for
an empty payload (what a parameter-server step through shared memory sends: headers only),
64 KiB and 4 MB (a 1M-parameter model), plain and encrypted.

    .venv/bin/python benchmarks/bench_framing.py [--seconds 1.0] [--repeats 5]

One client process alternates timed blocks of framed and bare round trips (each first in
turn); an echo server process answers both. The framing's CPU per frame is also given:
what both processes spent, per round trip, over the framed blocks. To compare two
versions of the framing, run this once on each (``git stash`` or ``git checkout REV --
sparkdl/net/framing.py``), alternating, and compare the ratios.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import echo, save_report  # noqa: E402

from sparkdl.errors import ProtocolError  # noqa: E402
from sparkdl.services.ps.protocol import PS_WIRE, Frame, Kind  # noqa: E402
from sparkdl.wire import framing  # noqa: E402


def bare_bytes(size: int) -> int:
    """What the bare socket echoes for a frame of ``size`` payload bytes: about the frame's
    own bytes (header and two tags), so that an empty payload still costs a round trip."""
    return PS_WIRE.header.size + 2 * framing.TAG_BYTES + size


def _echo_server(ready, secret: bytes, size: int, encrypt: bool) -> None:
    """Two connections, one after the other in the client's order: bare, then framed. Each
    is served on its own process thread until the client closes it."""
    listener = socket.create_server(("127.0.0.1", 0))
    key = framing.ServerKey()
    ready.put((listener.getsockname()[1], key.public))
    into = bytearray(size)

    def bare(conn: socket.socket) -> None:
        echo(conn, bare_bytes(size))

    def framed(conn: socket.socket) -> None:
        with conn:
            _, channel = framing.server_hello(conn, secret, PS_WIRE, key, encrypt)
            place = memoryview(into)
            while True:
                try:
                    frame = channel.recv(size, into=lambda kind, fields, length: place[:length])
                except (ProtocolError, OSError):  # the client closed the connection
                    return
                channel.send(frame)

    threads = []
    for serve in (bare, framed):
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threads.append(threading.Thread(target=serve, args=(conn,), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()


def _client(
    port: int, server_key: bytes, secret: bytes, size: int, encrypt: bool, seconds: float, repeats: int, out
) -> None:
    bare = socket.create_connection(("127.0.0.1", port))
    framed_sock = socket.create_connection(("127.0.0.1", port))
    for sock in (bare, framed_sock):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    channel = framing.client_hello(
        framed_sock, secret, PS_WIRE, Frame(Kind.HELLO), encrypt, server_key=server_key
    )
    payload, answer = bytearray(os.urandom(size)), bytearray(bare_bytes(size))
    raw = bytes(bare_bytes(size))
    request = Frame(Kind.PUSH, payload=payload)
    place = memoryview(answer)

    def bare_trip() -> None:
        bare.sendall(raw)
        got = 0
        while got < len(raw):
            got += bare.recv_into(place[got:], len(raw) - got)

    def framed_trip() -> None:
        channel.send(request)
        channel.recv(size, into=lambda kind, fields, length: place[:length])

    def timed(trip) -> float:
        for _ in range(3):
            trip()  # warm
        trips, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            trip()
            trips += 1
        return trips / (time.perf_counter() - started)

    runs: dict[str, list[float]] = {"framed": [], "bare": []}
    order = (("framed", framed_trip), ("bare", bare_trip))
    for repeat in range(repeats):
        for way, trip in order if repeat % 2 == 0 else order[::-1]:
            runs[way].append(timed(trip))
    bare.close()
    framed_sock.close()
    out.put(runs)


def bench(size: int, encrypt: bool, seconds: float, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    ready, out, secret = ctx.Queue(), ctx.Queue(), os.urandom(32)
    server = ctx.Process(target=_echo_server, args=(ready, secret, size, encrypt))
    server.start()
    port, server_key = ready.get(timeout=60)
    client = ctx.Process(
        target=_client, args=(port, server_key, secret, size, encrypt, seconds, repeats, out)
    )
    client.start()
    runs = out.get(timeout=60 + 4 * seconds * repeats)
    client.join(60)
    server.join(60)
    median = {way: statistics.median(values) for way, values in runs.items()}
    return {
        "payload_bytes": size,
        "encrypted": encrypt,
        "round_trips_per_s": runs,
        "median_round_trips_per_s": median,
        "framed_vs_bare": median["framed"] / median["bare"],
        "framed_us_per_round_trip_over_bare": 1e6 / median["framed"] - 1e6 / median["bare"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=1.0, help="length of each timed block")
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks of each way")
    parser.add_argument("--sizes", default="0,65536,4000000", help="payload bytes, comma-separated")
    parser.add_argument("--output", default=str(HERE / "results/framing.json"))
    args = parser.parse_args()
    results = {"framing_version": framing.VERSION}
    for size in (int(each) for each in args.sizes.split(",")):
        for encrypt in (False, True):
            row = bench(size, encrypt, args.seconds, args.repeats)
            name = f"{size} bytes{' encrypted' if encrypt else ''}"
            results[name] = row
            ratio, extra = row["framed_vs_bare"], row["framed_us_per_round_trip_over_bare"]
            print(f"{name:>24}: framed/bare {ratio:.3f}, +{extra:.1f} us a round trip", flush=True)
    save_report(args.output, results=results)


if __name__ == "__main__":
    main()
