"""The layers a pipeline cuts a model between (:func:`pipeline_layers`): an ``nn.Sequential``'s
own, or a Hugging Face decoder's embedding, each of its blocks, its final norm and head, one
tensor between each and the next (issue 55 item 6).

A ``transformers`` causal language model whose config declares the base model's pipeline
plan (``base_model_pp_plan``: ``embed_tokens``, ``layers``, ``norm``, as Llama, Qwen, Mistral
and a hundred other families do) and whose model declares its head's (``_pp_plan``:
``lm_head``) is rewritten as an ``nn.Sequential`` of its own modules, not copies
(:func:`decoder_layers`):

- ``embed``: token ids -> hidden states;
- ``block_<i>``: hidden states -> hidden states, the model's ``i``-th block, given the causal
  mask and the rotary position embeddings the model's forward makes once for all its
  blocks (made once per batch shape for the blocks of a stage; the rotary module is rebuilt
  from the config on the blocks' device, never registered, so a stage's state is its weights);
- ``head``: the final norm, then the head: logits.

The pipeline cuts between them. A sequence input's rows are right-padded (sparkdl pads at
the end): under the causal mask a padded tail changes no earlier position, and the loss
leaves the padding out, so stage 0 takes the ids alone and the mask stays behind.

A family whose forward does more than its plan says (scaled embeddings, soft-capped logits)
would compute something else: :func:`check_same_forward` compares the layers' logits with the
model's own, on the driver before any worker starts and on rank 0 as it builds the stages,
and the model is refused where they differ. Sliding-window attention differs from the full
causal mask only past the window, which a short check cannot see: a window shorter than the
rows is refused (:func:`refuse_windowed_attention`).

The layers' state is the model's, under other names: :attr:`DecoderLayers.model_names`
maps each to the model's (``block_3.layer.mlp.up_proj.weight`` is
``model.layers.3.mlp.up_proj.weight``), so checkpoints and the final weights stay the
model's own; the parameters come in the model's order, which numbers the optimizer state.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from sparkdl.errors import ConfigError

#: The base model's plan a decoder needs, in its order.
_BASE_PLAN = ("embed_tokens", "layers", "norm")


class DecoderLayers(nn.Sequential):
    """A decoder's modules as a pipeline's layers (:func:`decoder_layers`)."""

    def __init__(self, layers: dict[str, nn.Module], model_names: dict[str, str], family: str) -> None:
        super().__init__()
        for name, layer in layers.items():
            self.add_module(name, layer)
        #: each state key of these layers -> the model's key for the same tensor
        self.model_names = model_names
        self.family = family


class _Embedding(nn.Module):
    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.embed_tokens(ids.long()))


class _BlockInputs:
    """What the model's forward hands every block besides the hidden states (the positions,
    the causal mask, the rotary embeddings), made as it makes them: once for a batch's shape,
    device and dtype, and shared by the blocks of a stage (constants of a step, without
    gradients; one mask held, as the model's own forward holds one)."""

    def __init__(self, config: Any, rotary_type: type[nn.Module] | None) -> None:
        self.config = config
        self.rotary_type = rotary_type
        self._made: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def __call__(self, hidden: torch.Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask

        key = (*hidden.shape[:2], hidden.device, hidden.dtype, torch.is_inference_mode_enabled())
        if self._made is None or self._made[0] != key:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            made: dict[str, Any] = {
                "position_ids": positions,
                "attention_mask": create_causal_mask(
                    config=self.config,
                    inputs_embeds=hidden,
                    attention_mask=None,
                    cache=None,
                    position_ids=positions,
                ),
            }
            if self.rotary_type is not None:  # built from the config where the blocks run; not state
                rotary = self.rotary_type(config=self.config).to(hidden.device)
                made["position_embeddings"] = rotary(hidden, position_ids=positions)
            self._made = (key, made)
        return self._made[1]


class _Block(nn.Module):
    """One block, given what the model's forward hands every block (:class:`_BlockInputs`)."""

    def __init__(self, layer: nn.Module, inputs: _BlockInputs) -> None:
        super().__init__()
        self.layer = layer
        self.inputs = inputs  # not a module: no state of its own

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.layer(hidden, use_cache=False, **self.inputs(hidden))
        return cast(torch.Tensor, out[0] if isinstance(out, tuple) else out)


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.lm_head(self.norm(hidden)))


def pipeline_layers(model: nn.Module) -> nn.Sequential:
    """The layers a pipeline cuts ``model`` between: its own where it is an ``nn.Sequential``,
    a Hugging Face decoder's embedding, blocks and head (:func:`decoder_layers`).

    Raises:
        ConfigError: neither.
    """
    if isinstance(model, nn.Sequential):
        return model
    if is_decoder(model):
        return decoder_layers(model)
    raise ConfigError(
        f"strategy = 'pipeline' cuts the model between its top-level layers, so model_fn must "
        f"return an nn.Sequential or a Hugging Face decoder with a pipeline plan (it returned "
        f"{type(model).__name__}); write the model as nn.Sequential(layer, layer, ...) whose layers "
        "each take one tensor, or use strategy = 'tensor' or 'fsdp'"
    )


def checked_pipeline_layers(model: nn.Module, length: int) -> nn.Sequential:
    """:func:`pipeline_layers`, a Hugging Face decoder's checked against the model itself
    (:func:`refuse_windowed_attention` for rows of ``length``, :func:`check_same_forward`)."""
    layers = pipeline_layers(model)
    if isinstance(layers, DecoderLayers):
        refuse_windowed_attention(model, length)
        check_same_forward(model, layers)
    return layers


def without_masks(named: list[tuple[str, Any]], drops_masks: bool) -> list[tuple[str, Any]]:
    """``named`` inputs less the boolean ones (a sequence's padding mask) where ``drops_masks``:
    a decoder's stage 0 takes its token ids alone (right-padded rows under a causal mask)."""
    if not drops_masks:
        return named
    return [(n, v) for n, v in named if not (isinstance(v, torch.Tensor) and v.dtype == torch.bool)]


def is_decoder(model: nn.Module) -> bool:
    """Whether ``model`` is a causal language model whose pipeline plan names its modules."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None) or {}
    head = getattr(model, "_pp_plan", None) or {}
    base = getattr(model, "base_model", None)
    return (
        tuple(plan)[:3] == _BASE_PLAN
        and "lm_head" in head
        and isinstance(base, nn.Module)
        and base is not model
        and all(isinstance(getattr(base, name, None), nn.Module) for name in _BASE_PLAN)
        and isinstance(getattr(model, "lm_head", None), nn.Module)
    )


def decoder_layers(model: nn.Module) -> DecoderLayers:
    """``model`` (:func:`is_decoder`) as the pipeline's layers: ``embed``, ``block_<i>`` for
    each block, ``head``; the modules are the model's own.

    Raises:
        ConfigError: the plan names more modules than these (a family the rewrite does not know).
    """
    config: Any = getattr(model, "config")  # noqa: B009 (a Hugging Face model's)
    plan = tuple(config.base_model_pp_plan)
    if plan != _BASE_PLAN:
        raise ConfigError(
            f"strategy = 'pipeline' cuts a Hugging Face decoder whose pipeline plan is {list(_BASE_PLAN)}; "
            f"{type(model).__name__}'s is {list(plan)}: write it as an nn.Sequential of one-tensor layers, "
            "or use strategy = 'tensor' or 'fsdp'"
        )
    base = cast(nn.Module, model.base_model)
    rotary = getattr(base, "rotary_emb", None)
    inputs = _BlockInputs(config, type(rotary) if rotary is not None else None)
    blocks = list(cast(nn.ModuleList, base.layers))[: getattr(config, "num_hidden_layers", None)]
    layers: dict[str, nn.Module] = {"embed": _Embedding(cast(nn.Module, base.embed_tokens))}
    for i, block in enumerate(blocks):
        layers[f"block_{i}"] = _Block(block, inputs)
    layers["head"] = _Head(cast(nn.Module, base.norm), cast(nn.Module, model.lm_head))
    return DecoderLayers(layers, _model_names(model, layers), type(model).__name__)


def _model_names(model: nn.Module, layers: dict[str, nn.Module]) -> dict[str, str]:
    """Each of the layers' state keys -> the model's key of the same tensor (by identity; a
    tensor the model holds under two keys, a tied one, by the matching ending)."""
    by_tensor: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(value), []).append(key)
    names: dict[str, str] = {}
    for name, layer in layers.items():
        for key, value in layer.state_dict(keep_vars=True).items():
            candidates = by_tensor.get(id(value), [])
            inner = key.split(".", 1)[-1]  # without the wrapper's own attribute
            found = (
                [c for c in candidates if c == key or c.endswith("." + key)]
                or [c for c in candidates if c.endswith("." + inner)]
                or candidates
            )
            if not found:
                raise ConfigError(
                    f"strategy = 'pipeline': {type(model).__name__}'s {name} holds {key!r}, which the "
                    "model's own state does not: write it as an nn.Sequential of one-tensor layers"
                )
            names[f"{name}.{key}"] = found[0]
    return names


def refuse_windowed_attention(model: nn.Module, length: int) -> None:
    """Refuse a decoder whose blocks attend through a sliding window shorter than the rows
    (``length``: ``data.max_sequence_length``): each block here takes the full causal mask,
    and a window only differs from it past its width, which a short check cannot see.

    Raises:
        ConfigError: names the window, the rows' length and the ways out.
    """
    config: Any = getattr(model, "config")  # noqa: B009 (a Hugging Face model's)
    window: Any = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    windowed = bool(window) and (kinds != {"full_attention"} or getattr(config, "use_sliding_window", True))
    if windowed and (length <= 0 or length > int(window)):
        raise ConfigError(
            f"strategy = 'pipeline' gives each block of {type(model).__name__} the full causal mask, but "
            f"its blocks attend through a sliding window of {window} positions and the rows are "
            f"{length or 'unbounded'} long: set data.max_sequence_length to at most {window}, or use "
            "strategy = 'tensor' or 'fsdp', which take the model as it is"
        )


def check_same_forward(model: nn.Module, layers: DecoderLayers) -> None:
    """Compare ``layers``' logits with ``model``'s own on a few ids (eval mode, no gradient).

    Raises:
        ConfigError: they differ: the family's forward does more than its plan.
    """
    config: Any = getattr(model, "config")  # noqa: B009 (a Hugging Face model's)
    vocab = int(getattr(config, "vocab_size", 2))
    window = getattr(config, "sliding_window", None) or 8  # within it (refuse_windowed_attention)
    length = min(8, int(getattr(config, "max_position_embeddings", 8) or 8), int(window))
    ids = (torch.arange(2 * length).reshape(2, length) * 7 + 3) % vocab
    first = next(model.parameters(), None)
    if first is not None:
        ids = ids.to(first.device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = model(input_ids=ids).logits
            got = layers(ids)
        same = got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
        why = (
            f"its logits differ on the same ids (by {(got - expected).abs().max().item():.3g})"
            if got.shape == expected.shape
            else f"its logits are {tuple(expected.shape)}, the layers' {tuple(got.shape)}"
        )
    except Exception as exc:  # a family whose blocks take other arguments
        same, why = False, f"its blocks fail taken one by one ({type(exc).__name__}: {str(exc)[:200]})"
    finally:
        model.train(training)
    if not same:
        raise ConfigError(
            f"strategy = 'pipeline' rewrites a Hugging Face decoder as its embedding, blocks and head, "
            f"but {layers.family}'s forward does more than those: {why}. Write it as an nn.Sequential of "
            "one-tensor layers, or use strategy = 'tensor' or 'fsdp', which take it as it is"
        )
