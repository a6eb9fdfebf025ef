"""Building the model, optimizer and loss a worker trains with, from the user's spec."""

from __future__ import annotations

import io
import itertools
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from sparkdl.config import OptimizerConfig, OptimizerName
from sparkdl.errors import ConfigError

ModelFn = Callable[[], nn.Module]
OptimizerFn = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
#: ``(module, mesh) -> None``: tensor parallelism's own split of the whole model over a group's
#: 1-D DeviceMesh (``strategy = "tensor"``), e.g. with ``parallelize_module``
ParallelizeFn = Callable[[nn.Module, Any], object]


def compile_module(module: nn.Module, backend: str) -> nn.Module:
    """``module``, compiled in place with ``torch.compile``'s ``backend`` (``training.compile``):
    its ``forward`` is replaced by the compiled one, so the module keeps its parameters, their
    names and its state dict (``torch.compile(module)`` would wrap it, every name prefixed
    ``_orig_mod.``), and strategies, checkpoints and the returned weights see the same model.
    Not ``nn.Module.compile()``: it compiles ``_call_impl``, a frame of torch's own, and with
    torch 2.13 traced no graph at all (the model ran eagerly; tests/unit/test_compile.py).

    Raises:
        ConfigError: ``backend`` is not one torch knows.
    """
    check_compile_backend(backend)
    module.forward = torch.compile(module.forward, backend=backend)
    return module


def check_compile_backend(backend: str) -> None:
    """Refuse a ``training.compile_backend`` torch does not know (on the driver, before any task).

    Raises:
        ConfigError: it is not among ``torch._dynamo.list_backends()``.
    """
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError(
            f"training.compile_backend = {backend!r} is not a torch.compile backend here; use one of "
            f"{sorted(known)} (inductor, the default, generates code; eager and aot_eager only trace)"
        )


def build_model(model_fn: ModelFn) -> nn.Module:
    """Call ``model_fn`` and check it returned a module."""
    module = model_fn()
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"model_fn returned {type(module).__name__}, not a torch.nn.Module; "
            "model_fn must build and return the model"
        )
    return module


def checkpoint_layers(module: nn.Module) -> list[str]:
    """Make each of ``module``'s layers recompute its activations in backward (PyTorch's
    composable ``checkpoint``: hooks, so names, state dicts and wrappers stay as they are);
    return their names. The layers are the top-level children with parameters, looked for
    below a module that has a single child with children of its own (a model wrapping one
    ``Sequential``; a pipeline's stage of one layer checkpoints that layer)."""
    from torch.distributed._composable import checkpoint

    prefix, node = "", module
    while len(children := list(node.named_children())) == 1 and next(children[0][1].children(), None):
        name, node = children[0]
        prefix += name + "."
    layers = [
        (prefix + name, child)
        for name, child in node.named_children()
        if next(child.parameters(), None) is not None
    ]
    for _, layer in layers:
        checkpoint(layer)
    return [name for name, _ in layers]


def build_on_meta(model_fn: ModelFn) -> nn.Module:
    """``model_fn()``'s module on the meta device (no memory for its weights: they are
    assigned or received after). Weights a model_fn loads itself (a pre-trained body) are
    not loaded there, which torch warns about once per tensor: not the user's to see, as the
    real weights come after."""
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.filterwarnings("ignore", message=r".*to a meta parameter in the current model.*")
        return build_model(model_fn)


def module_with_state(model_fn: ModelFn, state: Mapping[str, torch.Tensor]) -> nn.Module:
    """``model_fn()``'s module holding the tensors of ``state`` themselves, not copies.

    The module is built on the meta device (no memory for its own initial weights) and
    the state's tensors are assigned into it, so a model of N bytes costs N bytes, not
    2N. Parameters the module shares (tied weights) stay shared. A model_fn that cannot
    build on the meta device, or a module with tensors the state does not hold
    (non-persistent buffers), is built normally and the state copied in.
    """
    try:
        module = build_on_meta(model_fn)
        tied = tied_parameters(module)
        module.load_state_dict(state, assign=True)
    except ConfigError:
        raise
    except Exception:  # model_fn does something the meta device cannot: build it for real
        module = None
    if module is None or any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        module = build_model(model_fn)
        module.load_state_dict(state)
        return module
    for names in tied:
        shared = module.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, shared)
    return module


def tied_parameters(module: nn.Module) -> list[list[str]]:
    """Names of the parameters that are one object in ``module`` (groups of two or more)."""
    by_identity: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_identity.setdefault(id(param), []).append(name)
    return [names for names in by_identity.values() if len(names) > 1]


def cpu_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state as detached CPU tensors (what checkpoints and results carry)."""
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def state_to_bytes(module: nn.Module) -> bytes:
    """The module's state as ``torch.save`` bytes: tensors only, loadable with weights_only."""
    buffer = io.BytesIO()
    torch.save(cpu_state_dict(module), buffer)
    return buffer.getvalue()


def state_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """Load :func:`state_to_bytes` output; refuses anything but tensors (``weights_only``)."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def _fused_on_gpu(params: list[nn.Parameter]) -> bool | None:
    """True (``fused=True``, for Adam and AdamW) where every parameter is a plain CUDA
    floating-point tensor: PyTorch's fused kernel updates them all in one launch per step,
    where the default (foreach) launches one per operation of the update rule. Sharded
    (DTensor) and CPU parameters keep PyTorch's default (None)."""
    on_gpu = bool(params) and all(
        p.is_cuda and p.is_floating_point() and type(p.data) is torch.Tensor for p in params
    )
    return True if on_gpu else None


def build_optimizer(
    params: Iterable[nn.Parameter], optimizer_fn: OptimizerFn | None, config: OptimizerConfig
) -> torch.optim.Optimizer:
    """``optimizer_fn(params)`` if given, else the optimizer named by ``[optimizer]``."""
    if optimizer_fn is not None:
        optimizer = optimizer_fn(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer_fn returned {type(optimizer).__name__}, not a torch.optim.Optimizer"
            )
        return optimizer
    tensors = list(params)
    name = config.optimizer
    if name is OptimizerName.SGD:
        # not fused: on a step the fp16 scaler skips, fused SGD keeps momentum buffers it
        # allocated but never wrote (uninitialised memory) and steps on them next time
        return torch.optim.SGD(
            tensors, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    if name is OptimizerName.ADAM:
        return torch.optim.Adam(
            tensors, lr=config.lr, weight_decay=config.weight_decay, fused=_fused_on_gpu(tensors)
        )
    if name is OptimizerName.ADAMW:
        return torch.optim.AdamW(
            tensors, lr=config.lr, weight_decay=config.weight_decay, fused=_fused_on_gpu(tensors)
        )
    if name is OptimizerName.ADAGRAD:
        return torch.optim.Adagrad(tensors, lr=config.lr, weight_decay=config.weight_decay)
    raise ConfigError(
        f"optimizer = {name.value!r} trains full-batch, not step by step; it has no step-wise "
        "optimizer to build (TorchEstimator runs it, sparkdl.worker.full_batch)"
    )
