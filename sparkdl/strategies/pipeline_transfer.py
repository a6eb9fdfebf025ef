"""What a pipeline moves besides its activations: each stage's starting weights from rank 0,
a step's rows gathered to stage 0 and its labels to the last stage, tensors between stages
with their shape sent first, and the whole model and optimizer streamed to rank 0
(structure first, then tensor by tensor)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparkdl.errors import ConfigError
from sparkdl.strategies.pipeline_layout import PipelineGroups
from sparkdl.strategies.rows import padded
from sparkdl.training.optimizer_state import named_to_indexed


def send_stages(
    whole: dict[str, torch.Tensor],
    stage_names: list[list[str]],
    stage_of: Callable[[int], int],
    device: torch.device,
) -> None:
    """Rank 0's side of the start: every other rank's stage, tensor by tensor (``whole``: the
    whole model's state; ``stage_names``: each stage's entries, in its own order)."""
    for rank in range(1, dist.get_world_size()):
        for name in stage_names[stage_of(rank)]:
            dist.send(whole[name].to(device).contiguous(), dst=rank)


def receive_stage(state: dict[str, torch.Tensor]) -> None:
    """Every other rank's side: its stage's tensors from rank 0, in ``state``'s order, each
    straight into the tensor allocated for it."""
    with torch.no_grad():
        for tensor in state.values():
            if tensor.is_contiguous():
                dist.recv(tensor, src=0)
            else:  # a strided parameter: the bytes arrive in order, then take its strides
                arrived = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
                dist.recv(arrived, src=0)
                tensor.copy_(arrived)


@dataclass(frozen=True)
class StepRows:
    """What the last stage's loss needs during one step."""

    rows: int  # the pipeline's real rows (the rest is padding)
    labels: torch.Tensor | None
    weights: torch.Tensor | None
    global_rows: int


# ------------------------------------------------------------------ moving rows


def gather_rows(
    tensor: torch.Tensor, counts: list[int], dst: int, groups: PipelineGroups
) -> torch.Tensor | None:
    """Every worker's rows of ``tensor``, joined in stage order on rank ``dst`` (None elsewhere)."""
    part = padded(tensor, counts)
    if groups.rank != dst:
        dist.gather(part, None, dst=dst, group=groups.pipeline)
        return None
    every = [torch.empty_like(part) for _ in counts]
    dist.gather(part, every, dst=dst, group=groups.pipeline)
    return torch.cat([part[:count] for part, count in zip(every, counts, strict=True)])


def scatter_rows(
    output: torch.Tensor | None, counts: list[int], groups: PipelineGroups, device: torch.device
) -> torch.Tensor:
    """The last stage's ``output`` of every worker's rows (joined in stage order), each
    worker's own rows back to it."""
    last = groups.ranks[-1]
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    if output is not None:
        header = _header(output, device)
    dist.broadcast(header, src=last, group=groups.pipeline)
    dtype, shape = _shape_of(header)
    most = max(counts)
    mine = torch.empty((most, *shape[1:]), dtype=dtype, device=device)
    parts = None
    if output is not None:
        parts, start = [], 0
        for count in counts:
            part = mine.new_zeros(mine.shape)
            part[:count] = output[start : start + count]
            parts.append(part)
            start += count
    dist.scatter(mine, parts, src=last, group=groups.pipeline)
    return mine[: counts[groups.stage]]


_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
_HEADER = 10  # dtype, rank of the shape, up to 8 dimensions


def _header(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
        raise ConfigError(
            f"a pipeline stage's output of {tensor.dim()} dimensions ({tensor.dtype}) cannot travel "
            f"between stages: at most {_HEADER - 2} dimensions of one of {', '.join(map(str, _DTYPES))}"
        )
    values = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    return torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64, device=device)


def _shape_of(header: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    dtype, dims, *shape = (int(v) for v in header.tolist())
    return _DTYPES[dtype], tuple(shape[:dims])


def send_tensor(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
    dist.send(_header(tensor, tensor.device), dst=dst, group=group)
    dist.send(tensor.contiguous(), dst=dst, group=group)


def recv_tensor(src: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    dtype, shape = _shape_of(header)
    tensor = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(tensor, src=src, group=group)
    return tensor


def pad_rows(
    rows: torch.Tensor, size: int, filler: Callable[[], torch.Tensor], device: torch.device
) -> torch.Tensor:
    """``rows`` with copies of one row seen before (``filler``'s first) up to ``size`` rows
    (padding the loss leaves out)."""
    if len(rows) == size:
        return rows
    if len(rows) > size:
        raise RuntimeError(
            f"a pipeline step holds {len(rows)} rows, more than the {size} its micro-batches were sized "
            "for; this is a sparkdl bug, please report it"
        )
    row = filler()[:1].to(device=device, dtype=rows.dtype)
    return torch.cat([rows, row.expand(size - len(rows), *row.shape[1:])])


@dataclass(frozen=True)
class Slot:
    """Where a tensor was in a structure sent without it: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def without_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by a :class:`Slot`, the tensors appended to
    ``tensors`` in the order :func:`with_tensors` fills them back."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return Slot(tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: without_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [without_tensors(v, tensors) for v in value]
    return value


def with_tensors(value: Any, take: Callable[[Slot], torch.Tensor]) -> Any:
    if isinstance(value, Slot):
        return take(value)
    if isinstance(value, dict):
        return {k: with_tensors(v, take) for k, v in value.items()}
    if isinstance(value, list):
        return [with_tensors(v, take) for v in value]
    return value


def received_tensor(slot: Slot, src: int, groups: PipelineGroups) -> torch.Tensor:
    tensor = torch.empty(slot.shape, dtype=slot.dtype)
    dist.recv(tensor, src=src, group=groups.objects)
    return tensor


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it (nested dicts and lists) copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    return value


def merged_dicts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return merged


def merged_optimizer_states(parts: list[dict[str, Any]], whole_names: list[str]) -> dict[str, Any]:
    """The stages' optimizer states (keyed by parameter name) as the whole model's optimizer
    would number them; each param group's hyperparameters from stage 0."""
    groups = []
    for i, first in enumerate(parts[0]["param_groups"]):
        names = [name for part in parts for name in part["param_groups"][i]["params"]]
        groups.append({**first, "params": names})
    state = {name: value for part in parts for name, value in part["state"].items()}
    order = {name: i for i, name in enumerate(whole_names)}
    for group in groups:
        group["params"].sort(key=order.__getitem__)
    return named_to_indexed({"state": state, "param_groups": groups}, whole_names)
