"""Parameter-server transport (issue 4, item 9; issue 14): push+pull round trips per second
and bytes/s for models of about 1M and 10M parameters, against a bare loopback socket that
copies the same bytes back and forth, in one run; the same with ``runtime.encrypt`` (AES-256-GCM),
and the same while another process keeps ``--flood`` idle and half-open connections open
against the server (re-opening each one the server evicts). The client runs in its own process.

    .venv/bin/python benchmarks/bench_ps.py [--trips 30] [--flood 2000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import save_report  # noqa: E402

from sparkdl.config import PsMode  # noqa: E402
from sparkdl.ps.client import PsClient  # noqa: E402
from sparkdl.ps.server import ParameterServer  # noqa: E402
from sparkdl.ps.store import ShardStore, shard_count, split_into_shards  # noqa: E402

SECRET = os.urandom(32)


def model_of(params: int) -> nn.Module:
    width = int((params / 4) ** 0.5)  # four square layers
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(4)])


def bench_ps(params: int, shards: int, trips: int, encrypt: bool = False, flood: int = 0) -> dict:
    model = model_of(params)
    tensors = list(model.parameters())
    groups = split_into_shards(tensors, shard_count(tensors, shards))
    stores = [
        ShardStore([tensors[i] for i in g], lambda p: torch.optim.SGD(p, lr=0.0), PsMode.ASYNC, 1)
        for g in groups
    ]
    server = ParameterServer(stores, "127.0.0.1", SECRET, 60.0, 1 << 30, encrypt=encrypt)
    sizes = [s.numel for s in stores]
    real = server.endpoint(tuple(tuple(g) for g in groups))
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    flooding = ctx.Process(target=_flood, args=(server.port, flood, stop)) if flood else None
    if flooding is not None:
        flooding.start()
        time.sleep(3.0)  # the flood is in place before the worker connects
    out = ctx.Queue()
    proc = ctx.Process(target=_ps_client_sized, args=(real, sizes, trips, out))
    proc.start()
    result = out.get(timeout=600)
    proc.join(60)
    if flooding is not None:
        stop.set()
        flooding.join(60)
        result["refusals"] = server.refusals
    server.stop()
    result["params"] = sum(p.numel() for p in tensors)
    result["shards"] = len(stores)
    return result


def _ps_client_sized(endpoint, sizes, trips, out) -> None:
    torch.set_num_threads(1)
    client = PsClient(endpoint, 0, 0)
    grads = [torch.zeros(n) for n in sizes]
    client.pull(0)
    client.stats.bytes_sent = client.stats.bytes_received = 0
    started = time.perf_counter()
    for _ in range(trips):
        client.push_pull(0, 1, grads, 0)
    elapsed = time.perf_counter() - started
    moved = client.stats.bytes_sent + client.stats.bytes_received
    out.put({"trips_per_s": trips / elapsed, "bytes_per_s": moved / elapsed})
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


def _echo_server(listener: socket.socket, size: int, trips: int) -> None:
    conn, _ = listener.accept()
    buffer = bytearray(size)
    with conn:
        for _ in range(trips + 1):
            view, got = memoryview(buffer), 0
            while got < size:
                got += conn.recv_into(view[got:], size - got)
            conn.sendall(buffer)


def _bare_client(port: int, size: int, trips: int, out) -> None:
    payload = bytearray(size)
    buffer = bytearray(size)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def trip() -> None:
            sock.sendall(payload)
            view, got = memoryview(buffer), 0
            while got < size:
                got += sock.recv_into(view[got:], size - got)

        trip()
        started = time.perf_counter()
        for _ in range(trips):
            trip()
        elapsed = time.perf_counter() - started
    out.put({"trips_per_s": trips / elapsed, "bytes_per_s": 2 * size * trips / elapsed})


def bench_bare(size: int, trips: int) -> dict:
    listener = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=_echo_server, args=(listener, size, trips), daemon=True)
    thread.start()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_bare_client, args=(listener.getsockname()[1], size, trips, out))
    proc.start()
    result = out.get(timeout=600)
    proc.join(60)
    thread.join(60)
    listener.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trips", type=int, default=30)
    parser.add_argument("--shards", type=int, default=0, help="0 = sparkdl's choice (ps_shards = 0)")
    parser.add_argument("--flood", type=int, default=2000, help="idle connections of the flood run")
    parser.add_argument("--output", default=str(HERE / "results/ps_transport.json"))
    args = parser.parse_args()
    results = {}
    for label, params in (("1M", 1_000_000), ("10M", 10_000_000)):
        ps = bench_ps(params, args.shards, args.trips)
        encrypted = bench_ps(params, args.shards, args.trips, encrypt=True)
        flooded = bench_ps(params, args.shards, args.trips, flood=args.flood) if args.flood else None
        bare = bench_bare(ps["params"] * 4, args.trips)
        results[label] = {
            "sparkdl_ps": ps,
            "sparkdl_ps_encrypted": encrypted,
            "bare_socket": bare,
            "bytes_per_s_vs_bare": ps["bytes_per_s"] / bare["bytes_per_s"],
            "encrypted_vs_plain": encrypted["bytes_per_s"] / ps["bytes_per_s"],
        }
        if flooded is not None:
            results[label]["sparkdl_ps_flooded"] = flooded
            results[label]["flooded_vs_plain"] = flooded["trips_per_s"] / ps["trips_per_s"]
        print(label, {k: v for k, v in results[label].items() if k.endswith(("_bare", "_plain"))}, flush=True)
    save_report(
        args.output,
        results=results,
    )


if __name__ == "__main__":
    main()
