"""What a connection's handshake costs (issue 35): connect, the challenge, the HELLO, its
verification and the first answer, on the listener the driver's servers use, against a bare
loopback connect with one byte each way, alternated in timed blocks.

    .venv/bin/python benchmarks/bench_handshake.py [--seconds 1.0] [--repeats 5] [--encrypt]

To compare two versions (framing v6 without a key exchange, v7 with X25519), run it on each
(``git worktree add /tmp/v6 REV``, then ``PYTHONPATH=/tmp/v6 python benchmarks/bench_handshake.py``),
alternating, and compare the ratios.
"""

from __future__ import annotations

import argparse
import logging
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import save_report  # noqa: E402

import sparkdl  # noqa: E402
from sparkdl.services.ps.protocol import PS_WIRE, Frame, Kind, client_hello  # noqa: E402
from sparkdl.wire.listener import ConnectionListener  # noqa: E402

SECRET = b"k" * 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--encrypt", action="store_true")
    parser.add_argument("--output", default=str(HERE / "results/handshake.json"))
    args = parser.parse_args()

    listener = ConnectionListener(
        "127.0.0.1", PS_WIRE, SECRET, lambda hello, channel, peer: channel.send(Frame(Kind.ACK)),
        "bench-handshake", logging.getLogger("bench"), encrypt=args.encrypt,
    )  # fmt: skip
    bare = socket.create_server(("127.0.0.1", 0))
    bare_port = bare.getsockname()[1]

    def bare_serve() -> None:
        while True:
            try:
                conn, _ = bare.accept()
            except OSError:
                return
            with conn:
                if conn.recv(1):
                    conn.sendall(b"a")

    threading.Thread(target=bare_serve, daemon=True).start()

    def handshake() -> None:
        with socket.create_connection((listener.host, listener.port), timeout=5) as sock:
            channel = client_hello(
                sock, SECRET, rank=0, attempt=0, encrypt=args.encrypt, server_key=listener.public_key
            )
            assert channel.recv(1 << 16).kind is Kind.ACK

    def bare_trip() -> None:
        with socket.create_connection(("127.0.0.1", bare_port), timeout=5) as sock:
            sock.sendall(b"h")
            assert sock.recv(1) == b"a"

    def rate(trip) -> float:
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < args.seconds:
            trip()
            done += 1
        return done / (time.perf_counter() - started)

    for _ in range(20):  # warm-up
        handshake()
        bare_trip()
    framed, plain = [], []
    for repeat in range(args.repeats):
        first, second = (handshake, bare_trip) if repeat % 2 == 0 else (bare_trip, handshake)
        for trip in (first, second):
            (framed if trip is handshake else plain).append(rate(trip))
    listener.stop()
    bare.close()
    handshakes, connects = statistics.median(framed), statistics.median(plain)
    save_report(
        args.output,
        sparkdl=str(Path(sparkdl.__file__).parent),
        encrypt=args.encrypt,
        handshakes_per_s=handshakes,
        bare_connects_per_s=connects,
        ratio=handshakes / connects,
        us_per_handshake_over_bare=1e6 * (1 / handshakes - 1 / connects),
        framed=framed,
        bare=plain,
    )


if __name__ == "__main__":
    main()
