"""Bytes each worker sends per step with PEFT's LoRA against full fine-tuning (issue 55 item 2),
for all-reduce, weight averaging (every step), the synchronous parameter server and fsdp.

A tiny GPT-2 (2 layers, n_embd 64, 4 heads) reads each of a row's 64 features as one position
and classifies the last one (10 classes). Full fine-tuning trains all of it but the token
embedding (the rows arrive as ``inputs_embeds``, so it is unused); LoRA (r 8 on the attention's
q/k/v projection) freezes the base and trains the adapters, the input projection and the head.
Two workers run ``run_worker`` (what a barrier task calls) over gloo on loopback, no Spark; the
parameter server is hosted in this process. The figures are the strategies' own counters
(``bytes_sent`` of rank 0's history, the parameter server's with its frames' headers).

    .venv/bin/python benchmarks/bench_lora_bytes.py [--rows 512] [--batch-size 32] [--strategies fsdp]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import CLASSES, WIDTH, make_table, save_report  # noqa: E402

STRATEGIES = {
    "allreduce": {"strategy": "allreduce"},
    "weight_averaging tau=1": {"strategy": "weight_averaging", "sync_every": 1},
    "parameter_server sync": {"strategy": "parameter_server", "ps_mode": "sync"},
    # the frozen base is sharded and gathered (twice where backward passes through it); only the
    # trainable gradients are reduce-scattered: the figure is FSDP's own collectives, counted
    "fsdp": {"strategy": "fsdp"},
}


class TinyGpt(nn.Module):
    """GPT-2 over a row's features, one position each; with ``lora``, PEFT's LoRA on c_attn."""

    def __init__(self, lora: bool) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2Model

        config = GPT2Config(vocab_size=8, n_positions=WIDTH, n_embd=64, n_layer=2, n_head=4)
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        base = GPT2Model(config)
        base.wte.requires_grad_(False)  # rows come in as inputs_embeds
        if lora:
            from peft import LoraConfig, get_peft_model

            base = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"]))
        self.embed = nn.Linear(1, 64)
        self.body = base
        self.head = nn.Linear(64, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.body(inputs_embeds=self.embed(x.unsqueeze(-1))).last_hidden_state
        return self.head(hidden[:, -1])


def lora_model() -> nn.Module:
    return TinyGpt(lora=True)


def full_model() -> nn.Module:
    return TinyGpt(lora=False)


def _worker(rank: int, spec: Any, rows: int, store: str, out: Any) -> None:
    import torch.distributed as dist

    from sparkdl.worker.assembly import Placement, run_worker

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    files = dist.FileStore(store, 2)
    files.set_timeout(timedelta(seconds=60))
    rounds = iter(range(1_000))

    def all_gather(message: str) -> list[str]:
        round_ = next(rounds)
        files.set(f"msg{round_}-{rank}", message)
        return [files.get(f"msg{round_}-{r}").decode() for r in range(2)]

    table = make_table(rows, seed=rank)
    result = run_worker(spec, iter(table.to_batches()), Placement(rank, 2, "127.0.0.1"), all_gather)
    out.put((rank, result.history))


def measure(model_fn: Any, settings: dict[str, Any], rows: int, batch_size: int) -> dict[str, float]:
    """Rank 0's bytes sent (and received, for the server) per step, one epoch on two workers."""
    from sparkdl.config import SparkDLConfig
    from sparkdl.data.columns import LabelKind
    from sparkdl.data.inputs import plan_data
    from sparkdl.worker.assembly import TrainSpec

    table = make_table(8)
    plan = plan_data(
        table.schema, feature_cols=("features",), label_col="label", label_kind=LabelKind.CLASS_INDEX
    )
    config = SparkDLConfig().replace(
        num_workers=2, batch_size=batch_size, epochs=1, optimizer="sgd", lr=0.05, progress=False, **settings
    )
    spec = TrainSpec(config, model_fn, None, "cross_entropy", plan)
    hosted = None
    if settings["strategy"] == "parameter_server":
        from sparkdl.spark.ps_host import host_parameter_server

        hosted = host_parameter_server(spec, "127.0.0.1")
        spec = hosted.spec
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    try:
        with tempfile.TemporaryDirectory() as folder:
            store = str(Path(folder) / "store")
            procs = [ctx.Process(target=_worker, args=(r, spec, rows, store, out)) for r in range(2)]
            for p in procs:
                p.start()
            histories = dict(out.get(timeout=600) for _ in procs)
            for p in procs:
                p.join(60)
    finally:
        if hosted is not None:
            hosted.stop()
    epoch = histories[0][0]
    steps = epoch["steps"]
    return {
        "steps": steps,
        "bytes_sent_per_step": epoch["bytes_sent"] / steps,
        "bytes_received_per_step": epoch.get("bytes_received", 0) / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512, help="rows per worker")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--output", default="benchmarks/results/lora_bytes.json")
    parser.add_argument("--strategies", nargs="*", choices=list(STRATEGIES), help="default: all")
    args = parser.parse_args()
    sizes = {}
    for name, fn in (("lora", lora_model), ("full", full_model)):
        model = fn()
        sizes[name] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        }
    rows = []
    for strategy, settings in STRATEGIES.items():
        if args.strategies and strategy not in args.strategies:
            continue
        figures = {
            name: measure(fn, settings, args.rows, args.batch_size)
            for name, fn in (("lora", lora_model), ("full", full_model))
        }
        lora, full = figures["lora"]["bytes_sent_per_step"], figures["full"]["bytes_sent_per_step"]
        rows.append(
            {
                "strategy": strategy,
                **{f"{k}_{n}": v for n, f in figures.items() for k, v in f.items()},
                "ratio": lora / full,
            }
        )
    save_report(args.output, models=sizes, rows=rows)
    print(f"{'strategy':28} {'LoRA B/step':>12} {'full B/step':>12} {'ratio':>7}")
    for row in rows:
        print(
            f"{row['strategy']:28} {row['bytes_sent_per_step_lora']:12,.0f} "
            f"{row['bytes_sent_per_step_full']:12,.0f} {row['ratio']:7.4f}"
        )
    lora, full = sizes["lora"], sizes["full"]
    print(
        f"trainable values: LoRA {lora['trainable']:,} of {lora['parameters']:,}; full {full['trainable']:,}"
    )


if __name__ == "__main__":
    main()
