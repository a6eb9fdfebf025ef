"""The widths a model sends under model parallelism and sufficient factors, read off the model
and a few rows: the cost model's :class:`~sparkdl.advisor.costmodel.ModelShape`.

One forward of the rows through the whole model, on the driver's CPU, with a hook on each
layer that a pipeline would cut after and each layer tensor parallelism would split: the
bytes per row of what crosses a cut, and of what a split layer all-reduces (a rows or
vocabulary layer's output, a columns layer's input where autograd sends it a gradient), as
the strategies' own traffic counters count them. Where the settings cannot split the model
(no ``nn.Sequential`` to cut, no pair to split) that part is left empty. Pure torch.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from sparkdl.advisor.costmodel import ModelShape
from sparkdl.comm.factors import factorable
from sparkdl.config import SparkDLConfig
from sparkdl.data.tensors import Batch, call_model
from sparkdl.errors import ConfigError
from sparkdl.strategies.pipeline import PipelineStrategy
from sparkdl.strategies.tensor import COLUMNS, ROWS, TensorParallelStrategy


def model_shape(
    module: nn.Module, batch: Batch, config: SparkDLConfig, workers: int, keyword: bool = False
) -> ModelShape:
    """What ``module`` would send per row of ``batch`` under ``config``'s pipeline cut and
    tensor plan on ``workers`` workers (:class:`ModelShape`)."""
    rows = max(len(batch), 1)
    starts = _pipeline_starts(module, config, workers)
    plan = _tensor_plan(module, config, workers)
    children = list(module.children()) if starts else []
    after_cut = {children[start - 1] for start in starts[1:]} if starts else set()
    cut_bytes: dict[nn.Module, float] = {}
    split_bytes: dict[str, float] = {}
    linears = factorable(module)
    seen_rows = dict.fromkeys((id(layer) for _, layer in linears), 0.0)

    def at_cut(layer: nn.Module, args: Any, output: Any) -> None:
        if layer in after_cut and isinstance(output, torch.Tensor):
            cut_bytes.setdefault(layer, output.nbytes / rows)

    def split(name: str, how: str) -> Any:
        def hook(layer: nn.Module, args: Any, output: Any) -> None:
            if how == COLUMNS:  # its input's gradient is summed, where autograd sends one
                seen = args[0] if args and isinstance(args[0], torch.Tensor) else None
                split_bytes[name] = seen.nbytes / rows if seen is not None and seen.requires_grad else 0.0
            elif isinstance(output, torch.Tensor):  # its partial outputs are summed
                split_bytes[name] = output.nbytes / rows

        return hook

    def factor_rows(layer: nn.Module, args: Any, output: Any) -> None:
        # the rows its factors hold: every call's, a sequence's positions each a row
        if args and isinstance(args[0], torch.Tensor) and isinstance(layer, nn.Linear):
            seen_rows[id(layer)] += args[0].numel() / layer.in_features / rows

    handles = [child.register_forward_hook(at_cut) for child in after_cut]
    for name, how in plan.items():
        handles.append(module.get_submodule(name).register_forward_hook(split(name, how)))
    handles += [layer.register_forward_hook(factor_rows) for _, layer in linears]
    try:
        with torch.enable_grad():
            call_model(module, batch, keyword)
    finally:
        for handle in handles:
            handle.remove()
    stage_params = (
        tuple(
            sum(p.numel() for layer in children[a:b] for p in layer.parameters())
            for a, b in itertools.pairwise([*starts, len(children)])
        )
        if starts
        else ()
    )
    inputs = sum(t.nbytes for t in batch.inputs.values()) / rows
    label = batch.label.nbytes / rows if batch.label is not None else 0.0
    return ModelShape(
        linears=tuple((layer.in_features, layer.out_features) for _, layer in linears),
        linear_rows=tuple(seen_rows[id(layer)] for _, layer in linears),
        cut_bytes=tuple(cut_bytes.get(children[start - 1], 0.0) for start in starts[1:]) if starts else (),
        stage_params=stage_params,
        split_bytes=sum(split_bytes.values()),
        split_collectives=sum(1 for b in split_bytes.values() if b > 0),
        split_params=sum(_sharded(module.get_submodule(name), how) for name, how in plan.items()),
        split_compute=_split_compute(module, plan),
        input_bytes=inputs,
        label_bytes=label,
    )


def _pipeline_starts(module: nn.Module, config: SparkDLConfig, workers: int) -> list[int]:
    """Where each stage would start (the pipeline strategy's own cut); [] where it cannot cut."""
    try:
        return PipelineStrategy.cut(module, config, workers)[:-1]
    except ConfigError:
        return []


def _tensor_plan(module: nn.Module, config: SparkDLConfig, workers: int) -> dict[str, str]:
    """The layers tensor parallelism would split, and how; {} where it splits none."""
    try:
        size = config.tensor.tp_size or workers
        return TensorParallelStrategy.plan(module, size, config.tensor.tensor_plan)
    except ConfigError:
        return {}


def _sharded(layer: nn.Module, how: str) -> int:
    """The parameters of a split layer that its group shards (a rows layer keeps its bias whole
    on every worker: each adds it to the summed output)."""
    bias = getattr(layer, "bias", None)
    whole = bias.numel() if how == ROWS and isinstance(bias, torch.Tensor) else 0
    return sum(p.numel() for p in layer.parameters()) - whole


def _split_compute(module: nn.Module, plan: dict[str, str]) -> float:
    """The split layers' share of the model's fully connected work (an embedding's lookup is
    next to none, however many parameters it has)."""
    work = {name: layer.in_features * layer.out_features for name, layer in module.named_modules()
            if isinstance(layer, nn.Linear)}  # fmt: skip
    total = sum(work.values())
    return sum(work.get(name, 0) for name in plan) / total if total else 0.0
