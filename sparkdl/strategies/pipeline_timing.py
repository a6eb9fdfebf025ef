"""A pipeline cut where every stage takes about as long (``pipeline_balance = "time"``).

The parameter count says what a stage holds, not how long it runs: a convolution of few
weights over a large image, an attention block, a layer that only reshapes cost what their
parameters do not say. Before the barrier stage, the driver times each top-level layer's
forward and backward on a micro-batch made of the DataFrame's first rows (each layer on
the previous one's output, as the pipeline will run it), and cuts where the slowest stage
is as fast as it can be (:func:`~sparkdl.strategies.pipeline_layout.balance`). The cut
travels to the workers as ``split_before``, so every rank builds the same stages.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from sparkdl.config import PipelineBalance, SparkDLConfig, Strategy
from sparkdl.data.tensors import Batch
from sparkdl.errors import ConfigError
from sparkdl.strategies.pipeline_decoder import DecoderLayers, pipeline_layers, without_masks
from sparkdl.strategies.pipeline_layout import Layout, balance
from sparkdl.training.factory import build_model

log = logging.getLogger(__name__)

#: Timed passes per layer after one untimed (allocations, lazy initialisation); the median counts.
REPEATS = 3


def layer_seconds(layers: Sequence[nn.Module], x: torch.Tensor, repeats: int = REPEATS) -> list[float]:
    """Each layer's forward + backward seconds on ``x`` fed through the layers before it:
    the median of ``repeats`` passes after a warm-up. The backward computes the gradients
    of the layer's parameters and of its input, as a pipeline stage's does."""
    seconds: list[list[float]] = [[] for _ in layers]
    for attempt in range(repeats + 1):
        h = x
        for i, layer in enumerate(layers):
            given = h.detach().requires_grad_(h.is_floating_point())
            started = time.perf_counter()
            out = layer(given)
            wrt = [p for p in layer.parameters() if p.requires_grad] + (
                [given] if given.requires_grad else []
            )
            if out.requires_grad and wrt:
                torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            if attempt:
                seconds[i].append(time.perf_counter() - started)
            h = out.detach()
    return [statistics.median(s) for s in seconds]


def micro_batch(batch: Batch, config: SparkDLConfig, drops_masks: bool = False) -> torch.Tensor:
    """A micro-batch of the pipeline's size (``batch_size x accumulate_steps`` rows from each
    of its stages' workers, cut into ``microbatches``) made of ``batch``'s rows, repeated.
    ``drops_masks``: a decoder's boolean padding masks are left out (its stage 0 does so).

    Raises:
        ConfigError: the rows have more than one input (a pipeline's layers take one tensor).
    """
    inputs = dict(without_masks(list(batch.inputs.items()), drops_masks))
    if len(inputs) != 1:
        raise ConfigError(
            f"pipeline_balance = 'time' feeds the first layer one tensor, but the rows have "
            f"{len(inputs)} inputs ({', '.join(inputs)})"
        )
    (x,) = inputs.values()
    training, pipeline = config.training, config.pipeline
    stages = Layout.of(config, training.num_workers).stages
    rows = max(training.batch_size * training.accumulate_steps * stages // pipeline.microbatches, 1)
    repeats = -(-rows // len(x))
    return x.repeat(repeats, *([1] * (x.dim() - 1)))[:rows]


def timed_split(whole: nn.Sequential, x: torch.Tensor, stages: int) -> tuple[tuple[str, ...], list[float]]:
    """The layers that begin stages 2, 3, ... of the cut that evens out the layers' measured
    time, and each stage's seconds. A layer without trainable parameters (an activation)
    stays with the layer before it, so that every stage has something to train.

    Raises:
        ConfigError: fewer layers with trainable parameters than ``stages``.
    """
    named = list(whole.named_children())
    seconds = layer_seconds([layer for _, layer in named], x)
    heads = [i for i, (_, layer) in enumerate(named) if any(p.requires_grad for p in layer.parameters())]
    if len(heads) < stages:
        raise ConfigError(
            f"the model has {len(heads)} top-level layers with trainable parameters; it cannot be cut "
            f"into {stages} stages that each train: use fewer stages"
        )
    heads[0] = 0  # layers before the first trainable one go with it
    bounds = [*heads, len(named)]
    costs = [max(round(sum(seconds[a:b]) * 1e6), 1) for a, b in itertools.pairwise(bounds)]  # us
    starts = [heads[unit] for unit in balance(costs, stages)]
    per_stage = [sum(seconds[a:b]) for a, b in itertools.pairwise([*starts, len(named)])]
    return tuple(named[i][0] for i in starts[1:]), per_stage


def wants_time_cut(config: SparkDLConfig) -> bool:
    """Whether the pipeline cuts by measured time (``pipeline_balance = "time"``, no ``split_before``)."""
    pipeline = config.pipeline
    return (
        config.training.strategy is Strategy.PIPELINE
        and pipeline.pipeline_balance is PipelineBalance.TIME
        and not pipeline.split_before
    )


def cut_by_time(
    config: SparkDLConfig,
    model_fn: Callable[[], nn.Module],
    batch: Batch | None,
    whole: nn.Module | None = None,
) -> SparkDLConfig:
    """``config`` with ``split_before`` set by measured time, where the pipeline asks for it
    (:func:`wants_time_cut`); else ``config`` unchanged. ``whole``: a model ``model_fn``
    already built (the preflight's), timed instead of building another.

    Raises:
        ConfigError: no rows to time the layers on, or rows of several inputs.
    """
    if not wants_time_cut(config):
        return config
    if batch is None:
        raise ConfigError(
            "pipeline_balance = 'time' times the layers on the DataFrame's first rows, and none was "
            "usable; set pipeline_balance = 'parameters' or pipeline.split_before"
        )
    whole = build_model(model_fn) if whole is None else whole
    try:
        layers = pipeline_layers(whole)
    except ConfigError:  # the strategy's own check says how to fix it
        return config
    stages = Layout.of(config, config.training.num_workers).stages
    rows = micro_batch(batch, config, drops_masks=isinstance(layers, DecoderLayers))
    with torch.random.fork_rng():  # the timing's dropout draws leave the user's stream alone
        split, per_stage = timed_split(layers, rows, stages)
    log.info(
        "pipeline cut by measured time: stages begin at %s; forward + backward per micro-batch %s ms",
        ["(first)", *split], [round(s * 1e3, 2) for s in per_stage],
    )  # fmt: skip
    return config.replace(split_before=split)
