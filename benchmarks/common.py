"""The workload shared by every benchmark: synthetic data and one model, seeded."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

WIDTH, CLASSES = 64, 10


def save_report(path: str, **sections: Any) -> dict[str, Any]:
    """Write a benchmark's results as JSON, with the machine and command that produced them."""
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "command": " ".join(sys.argv),
        **sections,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return report


def make_data(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """10-class data: labels are the argmax of one fixed projection (the same for every seed,
    so ``make_data(n, seed=1)`` is a held-out set for ``make_data(m, seed=0)``)."""
    w = np.random.default_rng(12345).normal(size=(WIDTH, CLASSES)).astype(np.float32)
    x = np.random.default_rng(seed).normal(size=(rows, WIDTH)).astype(np.float32)
    y = (x @ w).argmax(axis=1).astype(np.int64)
    return x, y


def make_table(rows: int, seed: int = 0) -> Any:
    """:func:`make_data` as an Arrow table (features: list<float>, label: int64), what the
    benchmarks turn into DataFrames or feed to a worker directly."""
    import pyarrow as pa

    x, y = make_data(rows, seed)
    features = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])
    return pa.table({"features": features.cast(pa.list_(pa.float32())), "label": pa.array(y)})


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(WIDTH, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES)
    )


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def echo(conn: socket.socket, size: int) -> None:
    """Send back every ``size`` bytes received on ``conn``, until the peer closes it (a bare
    socket's round trip, for the transport benchmarks to compare against)."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    with conn:
        while True:
            got = 0
            while got < size:
                n = conn.recv_into(view[got:], size - got)
                if n == 0:
                    return
                got += n
            conn.sendall(buffer)
