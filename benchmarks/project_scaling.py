"""Scaling on paper (issue 15, item 5): the cost model (sparkdl/costmodel.py), calibrated on
this machine's slow-net runs (tests/unit/test_costmodel.py: within 16% of ten measured
fits), projected to 8-128 workers on 10, 25 and 100 Gbit/s, for the models of two
published results:

- Horovod (Sergeev and Del Balso, 2018): ResNet-101, ring all-reduce over 25 Gbit/s,
  about 90% scaling efficiency at 128 GPUs (4 per server);
- MXNet: ResNet-152 with a two-level (hierarchical) parameter server, 115x at 128 GPUs
  (8 per machine).

Step times are assumptions, not measurements (no GPU here): ResNet-101 fp32 on a P100 at
batch 64, about 0.5 s; ResNet-152 on a K80 at batch 32, about 1.6 s.

    .venv/bin/python benchmarks/project_scaling.py      # results/scaling_projection.json
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import save_report  # noqa: E402

from sparkdl.advisor.costmodel import Cluster, Link, Workload, step_cost  # noqa: E402
from sparkdl.comm.traffic import Pattern  # noqa: E402

MODELS = {
    "ResNet-101 (Horovod), 4 per host": (Workload(44_500_000, 0.50, 64), 4),
    "ResNet-152 (MXNet), 8 per host": (Workload(60_200_000, 1.60, 32), 8),
}
VARIANTS = [
    ("allreduce", Pattern.RING_OVERLAPPED, False, "none", 1),
    ("allreduce, hierarchy", Pattern.RING_OVERLAPPED, True, "none", 1),
    ("allreduce, 1bit", Pattern.RING_OVERLAPPED, False, "1bit", 1),
    ("weight_averaging tau=4", Pattern.RING_PERIODIC, False, "none", 4),
    ("parameter_server sync", Pattern.STAR, False, "none", 1),
    ("parameter_server sync, hierarchy", Pattern.STAR, True, "none", 1),
]
WORKERS = (8, 16, 32, 64, 128)
LINKS = (10, 25, 100)


def main() -> None:
    table = []
    for model, (work, per_host) in MODELS.items():
        for gbit in LINKS:
            for name, exchange, hierarchical, compression, tau in VARIANTS:
                row = {"model": model, "gbit_s": gbit, "variant": name}
                for n in WORKERS:
                    cost = step_cost(
                        exchange,
                        Cluster(n, per_host),
                        Link(gbit),
                        work,
                        hierarchical=hierarchical,
                        compression=compression,
                        tau=tau,
                    )
                    row[f"speedup_{n}"] = round(cost.speedup, 1)
                table.append(row)
                cells = " | ".join(f"{row[f'speedup_{n}']:.1f}" for n in WORKERS)
                print(f"| {model} | {gbit} | {name} | {cells} |")
    save_report(str(HERE / "results/scaling_projection.json"), workers=list(WORKERS), table=table)


if __name__ == "__main__":
    main()
