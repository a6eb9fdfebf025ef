"""Parameter-server transport (issue 4, item 9; issue 14): push+pull round trips per second
and bytes/s for models of about 1M and 10M parameters, against a bare loopback socket that
copies the same bytes back and forth, in one run; the same with ``runtime.encrypt`` (AES-256-GCM),
and the same while another process keeps ``--flood`` idle and half-open connections open
against the server (re-opening each one the server evicts). The client runs in its own process.

    .venv/bin/python benchmarks/bench_ps.py [--trips 30] [--repeats 5] [--flood 2000]

The same with the server's shared memory offered (as to a worker on the driver's host: only
headers cross the socket), for comparison; the target is about the sockets.

One client process alternates timed blocks of parameter-server round trips and bare-socket
round trips (the same bytes each way), so each ratio compares moments of the same run.
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

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import echo, save_report  # noqa: E402

from sparkdl.config import PsMode  # noqa: E402
from sparkdl.services.ps.client import PsClient  # noqa: E402
from sparkdl.services.ps.server import ParameterServer  # noqa: E402
from sparkdl.services.ps.sharding import shard_count, split_into_shards  # noqa: E402
from sparkdl.services.ps.store import ShardStore  # noqa: E402

SECRET = os.urandom(32)


def model_of(params: int) -> nn.Module:
    width = int((params / 4) ** 0.5)  # four square layers
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(4)])


def bench_ps(
    params: int,
    shards: int,
    trips: int,
    repeats: int = 5,
    encrypt: bool = False,
    flood: int = 0,
    shared: bool = False,
) -> dict:
    """Push+pull round trips against a bare loopback socket moving the same bytes: one client
    process alternates blocks of ``trips`` of each, ``repeats`` times (the bare block first in
    every other repeat), so both see the same machine at the same moments. ``shared``: the
    server offers its shared memory, as to a worker on the driver's host."""
    model = model_of(params)
    tensors = list(model.parameters())
    groups = split_into_shards(tensors, shard_count(tensors, shards))
    stores = [
        ShardStore([tensors[i] for i in g], lambda p: torch.optim.SGD(p, lr=0.0), PsMode.ASYNC, 1)
        for g in groups
    ]
    server = ParameterServer(
        stores,
        "127.0.0.1",
        SECRET,
        60.0,
        1 << 30,
        encrypt=encrypt,
        shared_memory_bytes=(1 << 30) if shared else 0,
    )
    sizes = [s.numel for s in stores]
    real = server.endpoint(tuple(tuple(g) for g in groups))
    echo = socket.create_server(("127.0.0.1", 0))
    echoing = threading.Thread(target=_echo_server, args=(echo, sum(sizes) * 4), daemon=True)
    echoing.start()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    flooding = ctx.Process(target=_flood, args=(server.port, flood, stop)) if flood else None
    if flooding is not None:
        flooding.start()
        time.sleep(3.0)  # the flood is in place before the worker connects
    out = ctx.Queue()
    proc = ctx.Process(target=_client, args=(real, sizes, echo.getsockname()[1], trips, repeats, out))
    proc.start()
    result = out.get(timeout=600)
    proc.join(60)
    echoing.join(60)
    echo.close()
    if flooding is not None:
        stop.set()
        flooding.join(60)
        result["refusals"] = server.refusals
    server.stop()
    for way in ("ps", "bare"):
        result[f"{way}_median_trips_per_s"] = statistics.median(result[f"{way}_trips_per_s"])
    result["ps_vs_bare"] = result["ps_median_trips_per_s"] / result["bare_median_trips_per_s"]
    result["params"] = sum(p.numel() for p in tensors)
    result["shards"] = len(stores)
    return result


def _client(endpoint, sizes, bare_port, trips, repeats, out) -> None:
    torch.set_num_threads(1)
    client = PsClient(endpoint, 0, 0)
    grads = [torch.zeros(n) for n in sizes]
    size = sum(sizes) * 4
    payload, buffer = bytearray(size), bytearray(size)
    with socket.create_connection(("127.0.0.1", bare_port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def bare_trip() -> None:
            sock.sendall(payload)
            view, got = memoryview(buffer), 0
            while got < size:
                got += sock.recv_into(view[got:], size - got)

        def timed(trip) -> float:
            trip()  # warm: the block starts with its buffers and caches in use
            started = time.perf_counter()
            for _ in range(trips):
                trip()
            return trips / (time.perf_counter() - started)

        ps_trip = lambda: client.push_pull(0, 1, grads, 0)  # noqa: E731
        client.pull(0)
        result: dict[str, list[float] | int] = {"ps_trips_per_s": [], "bare_trips_per_s": []}
        for repeat in range(repeats):
            order = (("ps", ps_trip), ("bare", bare_trip))
            for way, trip in order if repeat % 2 == 0 else order[::-1]:
                result[f"{way}_trips_per_s"].append(timed(trip))  # type: ignore[union-attr]
        sent = client.stats.bytes_sent + client.stats.bytes_received
        result["bytes_per_trip"] = sent // (repeats * (trips + 1) + 1)
        result["shared_areas"] = client.shared_areas
    out.put(result)
    client.close()


def _flood(port: int, count: int, stop) -> None:
    """Keep ``count`` connections open against the server, half of them with a HELLO begun
    and never finished; re-open each one the server closes, until ``stop``."""
    import selectors

    partial = b"SDNT" + bytes(16)
    selector = selectors.DefaultSelector()

    def open_one(index: int) -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            return
        sock.setblocking(False)
        if index % 2:
            sock.send(partial)
        selector.register(sock, selectors.EVENT_READ, index)

    for i in range(count):
        open_one(i)
    while not stop.is_set():
        for key, _ in selector.select(0.1):
            try:
                data = key.fileobj.recv(4096)
            except OSError:
                data = b""
            if not data:  # evicted or timed out: open another in its place
                selector.unregister(key.fileobj)
                key.fileobj.close()
                open_one(key.data)


def _echo_server(listener: socket.socket, size: int) -> None:
    """Send back every ``size`` bytes received, until the client closes the connection."""
    echo(listener.accept()[0], size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trips", type=int, default=30, help="round trips per timed block")
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks of each way")
    parser.add_argument("--shards", type=int, default=0, help="0 = sparkdl's choice (ps_shards = 0)")
    parser.add_argument("--flood", type=int, default=2000, help="idle connections of the flood run")
    parser.add_argument("--output", default=str(HERE / "results/ps_transport.json"))
    args = parser.parse_args()
    results = {}
    for label, params in (("1M", 1_000_000), ("10M", 10_000_000)):
        plain = bench_ps(params, args.shards, args.trips, args.repeats)
        encrypted = bench_ps(params, args.shards, args.trips, args.repeats, encrypt=True)
        shared = bench_ps(params, args.shards, args.trips, args.repeats, shared=True)
        results[label] = {"plain": plain, "encrypted": encrypted, "shared_memory": shared}
        summary = {
            "plain_vs_bare": plain["ps_vs_bare"],
            "encrypted_vs_bare": encrypted["ps_vs_bare"],
            "shared_memory_vs_bare": shared["ps_vs_bare"],
        }
        if args.flood:
            flooded = bench_ps(params, args.shards, args.trips, args.repeats, flood=args.flood)
            results[label]["flooded"] = flooded
            summary["flooded_vs_bare"] = flooded["ps_vs_bare"]
        results[label].update(summary)
        print(label, {k: round(v, 3) for k, v in summary.items()}, flush=True)
    save_report(args.output, results=results)


if __name__ == "__main__":
    main()
