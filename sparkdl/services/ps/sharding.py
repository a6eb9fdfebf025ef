"""How the parameter server splits a model into shards: how many (``ps_shards``, 0: by the
model's size), and which whole parameter tensors each holds. Only trainable parameters are
served: a frozen one (``requires_grad = False``, a LoRA model's base) never changes, so the
workers keep their own (:mod:`sparkdl.strategies.trainable`) and no push or pull carries it."""

from __future__ import annotations

from torch import nn

#: ``ps_shards = 0`` (auto): one shard per this many bytes of float32 parameters, at most
#: ``AUTO_MAX_SHARDS``. Each shard costs every worker a round trip and the server a thread
#: per step, and the frames' hashing holds the GIL on both ends: for a small model shards
#: are pure overhead (the strategies benchmark's 340 KB model: 4 shards reached 0.31 of
#: all-reduce's samples/s, one shard 0.76); push+pull round trips per second (bench_ps):
#: 4 MB 196 / 171 / 145 with 1 / 2 / 4 shards, 40 MB 17.0 / 18.0 / 16.6.
AUTO_SHARD_BYTES = 16_000_000
AUTO_MAX_SHARDS = 4


def shard_count(params: list[nn.Parameter], requested: int) -> int:
    """How many shards ``ps_shards = requested`` means for ``params`` (0 = by their size)."""
    return shards_for(sum(p.numel() for p in params), requested)


def shards_for(values: int, requested: int) -> int:
    """How many shards ``ps_shards = requested`` means for ``values`` float32 parameters."""
    if requested > 0:
        return requested
    return max(1, min(AUTO_MAX_SHARDS, 4 * values // AUTO_SHARD_BYTES))


def split_into_shards(params: list[nn.Parameter], shards: int) -> list[list[int]]:
    """Assign whole parameter tensors to ``shards`` groups of similar size (largest first)."""
    shards = max(1, min(shards, len(params)))
    groups: list[list[int]] = [[] for _ in range(shards)]
    sizes = [0] * shards
    for index in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        target = sizes.index(min(sizes))
        groups[target].append(index)
        sizes[target] += params[index].numel()
    return [sorted(g) for g in groups if g]


def shard_trainable(params: list[nn.Parameter], requested: int) -> list[list[int]]:
    """The shards of ``params``' trainable tensors (``ps_shards = requested``), as indices into
    ``params`` (every parameter of the model, in order, as every worker numbers them)."""
    trainable = [i for i, p in enumerate(params) if p.requires_grad]
    served = [params[i] for i in trainable]
    groups = split_into_shards(served, shard_count(served, requested)) if served else []
    return [[trainable[i] for i in group] for group in groups]
