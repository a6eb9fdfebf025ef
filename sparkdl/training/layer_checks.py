"""What a layer of the user's model expected, against what the preflight batch gave it.

Used by :mod:`sparkdl.training.preflight`: the layer that was running when a forward pass
failed (found with forward hooks) is compared with its input, and the mismatch is said in
the user's terms (the feature columns, the widths, the layout a layer expects, the fix).
Pure torch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from sparkdl.data.tensors import Batch

CONV_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_EMBEDDING = (nn.Embedding, nn.EmbeddingBag)
_LAYOUTS = {1: "(N, C, L)", 2: "(N, C, H, W)", 3: "(N, C, D, H, W)"}


@dataclass(frozen=True)
class Sample:
    """The preflight batch and how to name its parts to the user."""

    batch: Batch
    keyword: bool  # the model takes its inputs by name
    y: torch.Tensor
    features: str  # e.g. "the feature columns ['x']"
    label: str  # e.g. "the label column 'y'"
    label_integer: bool

    @property
    def x(self) -> torch.Tensor | None:
        """The one input of feature_cols (None when the model takes named inputs)."""
        return None if self.keyword else next(iter(self.batch.inputs.values()))


@dataclass(frozen=True)
class Call:
    name: str
    module: nn.Module
    input: Any
    first: bool  # the first layer with parameters that ran


class Trace:
    """Follows the leaf modules a forward pass runs (hooks on the throwaway model)."""

    def __init__(self, module: nn.Module) -> None:
        self.running: Call | None = None
        self.first: Call | None = None
        self.last_done: tuple[str, Any] | None = None
        self._handles: list[RemovableHandle] = []
        for name, sub in module.named_modules():
            if next(sub.children(), None) is None:
                self._handles.append(sub.register_forward_pre_hook(functools.partial(self._enter, name)))
                self._handles.append(sub.register_forward_hook(functools.partial(self._exit, name)))

    def remove(self) -> None:
        """Take the hooks off the model: the model and this trace then hold no reference
        cycle, so the model is freed as soon as its last user lets it go."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        first = self.first is None and next(module.parameters(recurse=False), None) is not None
        self.running = Call(name, module, args[0] if args else None, first)
        if first:
            self.first = self.running

    def _exit(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.running = None
        self.last_done = (name, output)


def layer_problem(call: Call, sample: Sample) -> str | None:
    """Why the input of the layer ``call`` cannot work, in the user's terms; None if nothing
    recognisable (the original error is then reported as it is)."""
    layer, inp = call.module, call.input
    if not isinstance(inp, torch.Tensor):
        return None
    # the features of feature_cols, reshaped by no one
    features = call.first and sample.x is not None and inp.shape == sample.x.shape
    if isinstance(layer, _EMBEDDING):
        return _embedding_problem(call, inp, features, sample)
    params = list(layer.parameters(recurse=False))
    if params and params[0].is_floating_point() and inp.dtype != params[0].dtype:
        return (
            f"layer {call.name!r} ({layer!r}) holds {dtype_text(params[0])} weights but gets "
            f"{dtype_text(inp)} inputs{'; the feed gives float32 features' if features else ''}; build "
            "the model in float32 (no .double() or .half() in model_fn) or cast the input in forward"
        )
    if isinstance(layer, CONV_LAYERS):
        return _conv_problem(call, layer, inp, features, sample)
    if isinstance(layer, nn.RNNBase):
        return _rnn_problem(call, layer, inp, features, sample)
    # A LazyLinear not yet run has in_features 0: it takes any width.
    expected = layer.in_features if isinstance(layer, nn.Linear) else 0
    if not expected or inp.ndim < 1 or inp.shape[-1] == expected:
        return None
    got = inp.shape[-1]
    if features:
        return (
            f"{sample.features} give {got} values per row; the model's first layer expects {expected} "
            f"({layer!r}); make model_fn's first layer take {got} inputs or change feature_cols"
        )
    return (
        f"layer {call.name!r} ({layer!r}) expects {expected} values per row, but the layers before it "
        f"give {got} (its input is {describe(inp)}); make that layer take {got} inputs in model_fn, "
        "or change the layer before it"
    )


def _embedding_problem(call: Call, inp: torch.Tensor, features: bool, sample: Sample) -> str | None:
    layer = call.module
    if inp.is_floating_point() or inp.is_complex():
        if features:
            return (
                f"{sample.features} reach the model as {dtype_text(inp)} values (feature_cols gives one "
                f"float32 matrix), but the model's first layer {layer!r} takes integer ids; feed them "
                "as a named input, which keeps integers int64 (inputs={'ids': 'column'}, the model "
                "called as model(ids=...)), or convert them with x.long() in forward"
            )
        return (
            f"layer {call.name!r} ({layer!r}) takes integer ids but gets {dtype_text(inp)} values; "
            "convert them with .long() before it"
        )
    count = int(getattr(layer, "num_embeddings", 0))
    if inp.numel() and (int(inp.min()) < 0 or int(inp.max()) >= count):
        return (
            f"layer {call.name!r} ({layer!r}) holds ids 0..{count - 1} but gets ids from "
            f"{int(inp.min())} to {int(inp.max())}{f' from {sample.features}' if features else ''}; "
            f"make num_embeddings at least {int(inp.max()) + 1} or re-index the ids"
        )
    return None


def _conv_problem(
    call: Call, layer: nn.Module, inp: torch.Tensor, features: bool, sample: Sample
) -> str | None:
    dims = len(getattr(layer, "kernel_size", ()))
    channels = int(getattr(layer, "in_channels", 0))
    layout = _LAYOUTS[dims].replace("C", str(channels))
    if features and inp.ndim < dims + 2:
        width = inp.shape[-1]
        return (
            f"{sample.features} give {width} values per row, as a flat {shape_text((width,))} batch; the "
            f"model's first layer {layer!r} expects {layout}; {_unflatten_hint(width, channels, dims)}"
        )
    if inp.ndim not in (dims + 1, dims + 2):
        return f"layer {call.name!r} ({layer!r}) expects {layout} but gets {describe(inp)}"
    got = inp.shape[1] if inp.ndim == dims + 2 else inp.shape[0]
    if got == channels:
        return None
    return (
        f"layer {call.name!r} ({layer!r}) expects {channels} input channels, {layout}, but gets "
        f"{describe(inp)} ({got} channels); make its in_channels {got} or fix the reshape before it"
    )


def _unflatten_hint(width: int, channels: int, dims: int) -> str:
    per_channel, rest = divmod(width, channels)
    if rest:
        return f"{width} values cannot be split into {channels} channels: change in_channels or feature_cols"
    side = round(per_channel ** (1 / dims))
    shape = (channels, per_channel) if dims == 1 else (channels, *[side] * dims)
    if math.prod(shape) != width:
        return (
            f"reshape them first in model_fn (nn.Unflatten) into {channels} channels of {per_channel} values"
        )
    return f"reshape them first, e.g. with nn.Unflatten(1, {shape}) as model_fn's first layer"


def _rnn_problem(
    call: Call, layer: nn.RNNBase, inp: torch.Tensor, features: bool, sample: Sample
) -> str | None:
    size = layer.input_size
    layout = f"(N, L, {size})" if layer.batch_first else f"(L, N, {size}), or (N, L, {size}) with batch_first"
    if features and inp.ndim == 2:
        return (
            f"{sample.features} give {inp.shape[-1]} values per row, as a flat {shape_text(inp.shape[1:])} "
            f"batch; the model's first layer {layer!r} expects sequences {layout}; reshape them in "
            f"forward, e.g. x.view(len(x), -1, {size}) with batch_first=True"
        )
    if inp.shape[-1] == size:
        return None
    return (
        f"layer {call.name!r} ({layer!r}) expects {size} values per step, {layout}, but gets "
        f"{describe(inp)}; make its input_size {inp.shape[-1]} or fix the reshape before it"
    )


# --------------------------------------------------------------------------- output vs. label


def shape_text(row_shape: tuple[int, ...] | torch.Size) -> str:
    """A batch shape in the user's terms: ``(N, 2)`` for rows of 2 values."""
    return "(" + ", ".join(["N", *(str(d) for d in row_shape)]) + (",)" if not row_shape else ")")


def dtype_text(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {dtype_text(value)}"
    if isinstance(value, (tuple, list)):
        return type(value).__name__ + "(" + ", ".join(describe(v) for v in value) + ")"
    return type(value).__name__
