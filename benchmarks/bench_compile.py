"""Samples/s of a training step with ``training.compile`` (torch.compile, inductor) against
eager (issue 55 item 4), and what the first step costs: the compile.

One process, one worker's step as ``fit`` takes it (forward, loss, backward, SGD step) on data
already in memory, no Spark: what ``compile`` changes is the model's step, so the feed and
the exchange are left out. The model is compiled as the workers compile it
(``sparkdl.training.factory.compile_module``: its ``forward`` in place). Two models:
``benchmarks/common.py``'s MLP (64-256-256-10, batch 128) and a tiny decoder-only transformer
(``sparkdl.apps.models.CausalLMFactory``: 2 blocks, dim 128, context 64, vocabulary 256,
batch 32). Eager and compiled are alternated ``--repeats`` times, each timing ``--steps``
steps after a warm-up; the compile is the first step's seconds less an eager step's.

    .venv/bin/python benchmarks/bench_compile.py [--steps 200] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import CLASSES, WIDTH, make_model, save_report  # noqa: E402
from sparkdl.apps.models import CausalLMFactory  # noqa: E402
from sparkdl.training.factory import compile_module  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]


def mlp_case(device: torch.device) -> tuple[Callable[[], nn.Module], Batch, int]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, WIDTH, generator=generator)
    y = torch.randint(0, CLASSES, (128,), generator=generator)
    return make_model, (x.to(device), y.to(device)), 128


def transformer_case(device: torch.device) -> tuple[Callable[[], nn.Module], Batch, int]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (32, 65), generator=generator)
    factory = CausalLMFactory(vocab_size=256, context=64)
    return factory, (tokens[:, :-1].to(device), tokens[:, 1:].to(device)), 32


CASES = {"mlp": mlp_case, "transformer": transformer_case}


def step_fn(module: nn.Module, batch: Batch) -> Callable[[], None]:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    x, y = batch

    def step() -> None:
        out = module(x)
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def timed(step: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(case: str, compiled: bool, steps: int, device: torch.device) -> dict[str, float]:
    model_fn, batch, rows = CASES[case](device)
    torch.manual_seed(0)
    module = model_fn().to(device)
    if compiled:
        torch._dynamo.reset()
        compile_module(module, "inductor")
    step = step_fn(module, batch)
    first = timed(step, device)
    for _ in range(5):  # warm-up (a recompile for the second call's grads, caches)
        step()
    seconds = sum(timed(step, device) for _ in range(steps))
    return {"first_step_s": first, "samples_per_s": rows * steps / seconds}


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--output", default=str(ROOT / "benchmarks/results/compile.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results: dict[str, Any] = {}
    for case in CASES:
        runs: dict[str, list[dict[str, float]]] = {"eager": [], "compiled": []}
        for _ in range(args.repeats):
            for mode in ("eager", "compiled"):
                runs[mode].append(measure(case, mode == "compiled", args.steps, device))
                print(case, mode, runs[mode][-1], flush=True)
        eager = statistics.median(r["samples_per_s"] for r in runs["eager"])
        compiled = statistics.median(r["samples_per_s"] for r in runs["compiled"])
        eager_step = statistics.median(r["first_step_s"] for r in runs["eager"])
        compile_s = statistics.median(r["first_step_s"] for r in runs["compiled"]) - eager_step
        results[case] = {
            "eager_samples_per_s": eager,
            "compiled_samples_per_s": compiled,
            "ratio": compiled / eager,
            "compile_s": compile_s,
            "runs": runs,
        }
    save_report(
        args.output,
        device=str(device),
        threads=args.threads,
        torch=torch.__version__,
        steps=args.steps,
        repeats=args.repeats,
        results=results,
    )


if __name__ == "__main__":
    main()
