"""Which layers tensor parallelism splits, and how (pure: ``torch.nn`` only, no DTensor):
the built-in plan (:func:`megatron_plan`: Megatron's pairs of linear layers, and
embeddings by their vocabulary), a user's ``tensor_plan`` by module name
(:func:`users_plan`), or what a user's ``parallelize_fn`` split, read back
(:func:`split_layers`). The strategy that applies a plan is :mod:`sparkdl.strategies.tensor`.

Between the two layers of a pair each worker holds a slice of the hidden features: the
layers there (:func:`inside_pairs`) see one slice, so a parameter of theirs gets one
slice's share of its gradient (the strategy sums it over the group), and a random draw
there must differ between the slices (the strategy gives them their own stream).

Tied weights (one parameter used by two layers, as a language model's head and its
embedding): splitting one use would leave the other whole, two copies trained apart. The
built-in plan leaves a tied layer whole (with its pair), a ``tensor_plan`` that names one
is refused (:func:`refuse_tied`), and so is a ``parallelize_fn`` that split one.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import cast

from torch import nn

from sparkdl.config import SparkDLConfig, Strategy
from sparkdl.errors import ConfigError
from sparkdl.training.factory import tied_parameters

COLUMNS, ROWS, VOCABULARY = "columns", "rows", "vocabulary"


#: Layers that act on each value alone (or pass it through): a split pair may have them
#: between its two linear layers, where each worker holds a slice of the hidden features.
ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid,
    nn.ELU, nn.CELU, nn.SELU, nn.Softplus, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh,
    nn.Dropout, nn.Identity,
)  # fmt: skip


def megatron_plan(module: nn.Module, size: int) -> dict[str, str]:
    """Which layers to split, and how: ``{name: "columns" | "rows" | "vocabulary"}``. A pair is,
    inside an ``nn.Sequential`` (whose order is the data's path), a ``Linear`` then, past
    element-wise layers only (:data:`ELEMENTWISE`: a softmax or a norm over the features
    would see one worker's slice), a ``Linear`` taking its output; the hidden width must
    divide by ``size`` (a pair that does not is left whole). A PReLU with one weight per
    feature is not element-wise across a split and ends a pair. An ``nn.Embedding`` is
    split by its rows, Megatron's vocabulary-parallel embedding: each worker holds a slice of
    the vocabulary, looks up the ids that fall in it, and one all-reduce sums the lookups
    (its vocabulary must divide by ``size``; one with ``max_norm`` or sparse gradients,
    which a slice cannot honour, stays whole). A layer whose weight another layer shares
    stays whole, with its pair."""
    plan: dict[str, str] = {}
    tied = tied_layers(module)
    for name, node in module.named_modules():
        if isinstance(node, nn.Embedding) and _splits(node, size) and name not in tied:
            plan[name] = VOCABULARY
    for parent, node in module.named_modules():
        if not isinstance(node, nn.Sequential):
            continue
        children = list(node.named_children())
        i = 0
        while i < len(children):
            name, first = children[i]
            j = i + 1
            while j < len(children) and _elementwise(children[j][1]):
                j += 1
            if isinstance(first, nn.Linear) and j < len(children):
                second_name, second = children[j]
                if (
                    isinstance(second, nn.Linear)
                    and second.in_features == first.out_features
                    and first.out_features % size == 0
                    and not {_joined(parent, name), _joined(parent, second_name)} & tied
                ):
                    plan[_joined(parent, name)] = COLUMNS
                    plan[_joined(parent, second_name)] = ROWS
                    i = j + 1
                    continue
            i += 1
    return plan


#: The dimension each way of splitting divides among the group.
_SPLIT_WIDTH = {COLUMNS: "out_features", ROWS: "in_features", VOCABULARY: "num_embeddings"}


#: Hugging Face's names for the two ways of splitting a linear layer (``base_model_tp_plan``).
_HF_STYLES = {"colwise": COLUMNS, "rowwise": ROWS}


def hugging_face_plan(module: nn.Module) -> list[str]:
    """A Hugging Face decoder's own tensor-parallel plan (its config's ``base_model_tp_plan``,
    e.g. Llama's: q/k/v and the MLP's gate and up by columns, the attention's output and the
    MLP's down by rows) as ``tensor_plan`` entries, named from ``module``; ``[]`` for a model
    without one, or one whose plan uses other styles than column- and row-wise."""
    for path, node in module.named_modules():
        given = getattr(getattr(node, "config", None), "base_model_tp_plan", None)
        if not given or not all(style in _HF_STYLES for style in given.values()):
            continue
        entries = [f"{_joined(path, name)}:{_HF_STYLES[style]}" for name, style in given.items()]
        names = [name for name, _ in module.named_modules()]
        if all(_matching(names, entry.rpartition(":")[0]) for entry in entries):
            return entries
    return []


def users_plan(module: nn.Module, size: int, given: Sequence[str]) -> dict[str, str]:
    """``tensor_plan``'s entries (``"name:columns|rows|vocabulary"``) as a plan, each checked
    against the layer it names. A ``*`` in a name stands for one part of a module's name
    (``model.layers.*.mlp.up_proj:columns``: every block's), as in ``parallelize_module``.
    A columns layer inside an attention module (one with a ``head_dim``) must split whole
    heads: its heads must divide by ``size``.

    Raises:
        ConfigError: an entry that is malformed, names no such layer, splits a layer of another
            kind, or a dimension (or a head count) that does not divide by ``size``.
    """
    names = [name for name, _ in module.named_modules() if name]
    expanded: list[str] = []
    for entry in given:
        name, _, how = entry.rpartition(":")
        matches = _matching(names, name) if "*" in name else []
        expanded.extend([f"{match}:{how}" for match in matches] or [entry])
    plan = _checked_plan(module, size, expanded)
    _refuse_split_heads(module, size, plan)
    refuse_tied(module, plan)
    return plan


def _matching(names: Sequence[str], pattern: str) -> list[str]:
    """The module names ``pattern`` matches, a ``*`` standing for one part of a name."""
    parts = pattern.split(".")
    return [
        name
        for name in names
        if len(name.split(".")) == len(parts)
        and all(fnmatch.fnmatchcase(a, b) for a, b in zip(name.split("."), parts, strict=True))
    ]


def _refuse_split_heads(module: nn.Module, size: int, plan: dict[str, str]) -> None:
    """Refuse a columns split of an attention projection that would cut a head in two."""
    for name, how in plan.items():
        parent = module.get_submodule(name.rpartition(".")[0])
        head_dim = getattr(parent, "head_dim", None)
        if how != COLUMNS or not isinstance(head_dim, int) or head_dim <= 0:
            continue
        heads = cast(nn.Linear, module.get_submodule(name)).out_features // head_dim
        if heads % size:
            raise ConfigError(
                f"tensor_plan splits {name!r} by columns over {size} workers, but it holds {heads} "
                f"attention heads (head_dim {head_dim}), which do not divide by {size}: each worker "
                f"must hold whole heads; set tp_size to a divisor of {heads}, or leave it whole"
            )


def _checked_plan(module: nn.Module, size: int, given: Sequence[str]) -> dict[str, str]:
    kinds = {COLUMNS: nn.Linear, ROWS: nn.Linear, VOCABULARY: nn.Embedding}
    plan: dict[str, str] = {}
    for entry in given:
        name, _, how = entry.rpartition(":")
        if not name or how not in kinds:
            raise ConfigError(
                f"tensor_plan entry {entry!r} is not 'layer.name:columns', ':rows' or ':vocabulary'"
            )
        try:
            layer = module.get_submodule(name)
        except AttributeError:
            raise ConfigError(
                f"tensor_plan names {name!r}, which is no module of the model; its modules are "
                f"{', '.join(n for n, _ in module.named_modules() if n)}"
            ) from None
        if not isinstance(layer, kinds[how]):
            raise ConfigError(
                f"tensor_plan splits {name!r} by {how}, which needs an nn.{kinds[how].__name__}; it is "
                f"{type(layer).__name__}"
            )
        width = getattr(layer, _SPLIT_WIDTH[how])
        if width % size:
            raise ConfigError(
                f"tensor_plan splits {name!r} by {how} over {size} workers, but its {width} do not divide "
                f"by {size}; set tp_size to a divisor of {width}"
            )
        plan[name] = how
    return plan


def tied_layers(module: nn.Module) -> set[str]:
    """The layers (module names) holding a parameter that another layer holds too."""
    return {name.rpartition(".")[0] for names in tied_parameters(module) for name in names}


def refuse_tied(module: nn.Module, plan: dict[str, str]) -> None:
    """Refuse a plan that splits a layer whose parameter another layer shares.

    Raises:
        ConfigError: naming the layers that share it, and the fixes.
    """
    for names in tied_parameters(module):
        layers = sorted({name.rpartition(".")[0] for name in names})
        split = [layer for layer in layers if layer in plan]
        if split:
            raise ConfigError(
                f"tensor parallelism would split {split[0]!r}, whose parameter {layers} share (tied "
                "weights): the other use would keep a whole copy, trained apart from the slices. Leave "
                f"{split[0]!r} whole (drop it from tensor_plan or parallelize_fn), or untie the weights"
            )


def refuse_untied(before: list[list[str]], after: list[list[str]]) -> None:
    """Refuse a split that left the tied parameter groups ``before`` (names) no longer one
    parameter ``after`` (what ``parallelize_fn`` did).

    Raises:
        ConfigError: naming the group that came apart.
    """
    kept = {frozenset(names) for names in after}
    for names in before:
        if frozenset(names) not in kept:
            layers = sorted({name.rpartition(".")[0] for name in names})
            raise ConfigError(
                f"parallelize_fn split a parameter that {layers} share (tied weights): the layers now "
                "hold a slice and a whole copy, trained apart. Leave the tied layers whole, or untie "
                "the weights"
            )


def inside_pairs(module: nn.Module, plan: dict[str, str]) -> list[str]:
    """The layers between the two of each split pair, inside an ``nn.Sequential`` (whose order
    is the data's path): a columns layer, then everything up to the rows layer after it.
    Outside a Sequential (an attention or MLP block, its layers attributes called in
    ``forward``), the module holding a rows layer and a columns layer: between them it
    computes on its slice of the heads or hidden features (attention dropout, a per-head
    norm's weight). Each worker runs them on its slice."""
    inside: list[str] = []
    for name, kind in plan.items():
        parent = name.rpartition(".")[0]
        if kind != ROWS or not parent or isinstance(module.get_submodule(parent), nn.Sequential):
            continue
        if any(other.rpartition(".")[0] == parent and plan[other] == COLUMNS for other in plan):
            inside.append(parent)
    for parent, node in module.named_modules():
        if not isinstance(node, nn.Sequential):
            continue
        between: list[str] | None = None
        for name, _ in node.named_children():
            full = _joined(parent, name)
            how = plan.get(full)
            if how == COLUMNS:
                between = []
            elif how == ROWS and between is not None:
                inside.extend(between)
                between = None
            elif between is not None:
                between.append(full)
    return inside


def check_parallelize_fn(config: SparkDLConfig) -> None:
    """Refuse a ``parallelize_fn`` the settings would not use, or would contradict.

    Raises:
        ConfigError: the strategy is not tensor parallelism, or ``tensor_plan`` is set too.
    """
    if config.training.strategy is not Strategy.TENSOR:
        raise ConfigError(
            f"parallelize_fn splits the model for strategy = 'tensor', but strategy = "
            f"{config.training.strategy.value!r}; set strategy = 'tensor', or drop parallelize_fn"
        )
    if config.tensor.tensor_plan:
        raise ConfigError(
            f"parallelize_fn and tensor_plan = {list(config.tensor.tensor_plan)} both say how to split the "
            "model; use one: drop tensor_plan (parallelize_fn replaces it), or drop parallelize_fn"
        )


def split_layers(module: nn.Module, size: int) -> dict[str, str]:
    """What a user's ``parallelize_fn`` split, read back from the weights' placements: a linear
    layer sharded by its outputs (``Shard(0)``) is a columns layer, by its inputs (``Shard(1)``)
    a rows layer; an embedding sharded by its vocabulary a vocabulary layer, by its width a
    columns one. The traffic counters follow it.

    Raises:
        ConfigError: no layer's weight is sharded over the group.
    """
    plan: dict[str, str] = {}
    for name, layer in module.named_modules():
        placements = getattr(getattr(layer, "weight", None), "placements", ())
        dims = [placement.dim for placement in placements if placement.is_shard()]
        if not dims or not isinstance(layer, nn.Linear | nn.Embedding):
            continue
        if isinstance(layer, nn.Embedding):
            plan[name] = VOCABULARY if dims[0] == 0 else COLUMNS
        else:
            plan[name] = COLUMNS if dims[0] == 0 else ROWS
    if not plan:
        raise ConfigError(
            f"parallelize_fn split no layer over the tensor-parallel group of {size} workers: every "
            "nn.Linear and nn.Embedding weight is whole; shard some with "
            "torch.distributed.tensor.parallel.parallelize_module(module, mesh, {name: ColwiseParallel(), "
            "...}) on the mesh it is given, or leave parallelize_fn unset for the built-in plan"
        )
    return plan


def _splits(embedding: nn.Embedding, size: int) -> bool:
    return embedding.num_embeddings % size == 0 and embedding.max_norm is None and not embedding.sparse


def _elementwise(layer: nn.Module) -> bool:
    if isinstance(layer, nn.PReLU):
        return layer.num_parameters == 1
    return isinstance(layer, ELEMENTWISE)


def _joined(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name
