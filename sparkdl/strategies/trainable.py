"""Which parameters the strategies move: those that require a gradient.

A frozen parameter (``requires_grad = False``: a LoRA/PEFT model's base, 99% of it) never
changes in training, so sending it would only repeat what every worker holds: all-reduce
keeps it out of DDP (its buckets and its starting broadcast), weight averaging out of its
averages and its outer optimizer, the parameter server out of its shards (the workers keep
their frozen weights, the driver hosts and updates only the trainable ones). The set is
decided once, when the strategy is built, from the model ``model_fn`` built; a parameter
frozen or unfrozen later is not followed.

Why the frozen weights agree without being sent: every worker seeds torch with
``training.seed`` right before it calls ``model_fn``
(:func:`sparkdl.worker.builder.start_worker`), and the parameter server's model on the
driver is built after the same seed (:mod:`sparkdl.spark.ps_host`), so a ``model_fn`` that
draws its randomness from torch, or loads the same pretrained weights, gives every worker
the same frozen weights. One that does not (numpy's or Python's random, a file that
differs between hosts) would train each worker against a different base; so
:func:`agree_on_frozen` checks it once at build time for a few numbers per worker, and
only where the workers differ sends rank 0's frozen weights to the others, once.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from sparkdl.comm.exchange import Exchange
from sparkdl.errors import ModelMismatchError, agreed

log = logging.getLogger(__name__)

#: Frozen weights whose sums differ by less than this, relative, count as the same (summing
#: the same values on different hardware may round differently; a different draw differs
#: in every value).
SAME_WITHIN = 1e-6


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module``'s parameters that require a gradient, by name, in module order."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def frozen_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module``'s parameters that do not require a gradient, by name, in module order."""
    return [(name, p) for name, p in module.named_parameters() if not p.requires_grad]


def fingerprint(module: nn.Module) -> torch.Tensor:
    """Four float64 numbers that tell two workers' models apart: trainable tensors, trainable
    values, and the sum and sum of squares of every frozen value."""
    trainable = [p for _, p in trainable_parameters(module)]
    frozen = [p for _, p in frozen_parameters(module)]
    total = sum((p.detach().double().sum() for p in frozen), torch.zeros((), dtype=torch.float64))
    squares = sum((p.detach().double().square().sum() for p in frozen), torch.zeros((), dtype=torch.float64))
    return torch.tensor(
        [len(trainable), sum(p.numel() for p in trainable), float(total), float(squares)], dtype=torch.float64
    )


def agree_on_frozen(module: nn.Module, exchange: Exchange, rank: int) -> bool:
    """Check, once at build time, that every worker trains the same parameters and holds the
    same frozen weights (a few numbers each, through the control group); where the frozen
    weights differ, replace them by rank 0's (one broadcast). Every rank calls it at the same
    point. Returns whether rank 0's frozen weights were sent.

    Raises:
        ModelMismatchError: the workers' models require gradients of different parameters
            (``model_fn`` freezes depending on the worker); raised on every rank alike.
    """
    if exchange.world_size <= 1:
        return False
    prints = exchange.gather_control(fingerprint(module)).tolist()
    shapes = {(int(p[0]), int(p[1])) for p in prints}
    if len(shapes) > 1:
        by_rank = ", ".join(
            f"rank {r}: {int(p[0])} tensors, {int(p[1])} values" for r, p in enumerate(prints)
        )
        raise agreed(
            ModelMismatchError(
                f"the workers' models do not train the same parameters ({by_rank}); every worker must "
                "freeze the same parameters: set requires_grad in model_fn the same way on every worker"
            )
        )
    first = prints[0]
    if all(_close(p[2], first[2]) and _close(p[3], first[3]) for p in prints):
        return False
    log.warning(
        "rank %d: the workers' frozen parameters differ (sums %s): model_fn does not build the same "
        "frozen weights everywhere (draw them with torch, which is seeded with training.seed, or load "
        "the same weights); sending rank 0's to every worker once",
        rank,
        [p[2] for p in prints],
    )
    with torch.no_grad():
        for _, p in frozen_parameters(module):
            exchange.broadcast_(p.data, src=0)
    return True


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= SAME_WITHIN * max(1.0, abs(a), abs(b))
