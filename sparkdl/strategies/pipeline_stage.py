"""A pipeline's stage on one worker: the run of the whole model's top-level layers it
holds, built so that only rank 0 ever holds the whole model (:func:`build_stage`), and
called as a module, the whole pipeline's forward in lockstep with the other stages
(:class:`StageModule`). The strategy is :mod:`sparkdl.strategies.pipeline`."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from sparkdl.config import SparkDLConfig
from sparkdl.errors import ConfigError
from sparkdl.strategies.pipeline_decoder import (
    DecoderLayers,
    checked_pipeline_layers,
    pipeline_layers,
    without_masks,
)
from sparkdl.strategies.pipeline_layout import Layout, PipelineGroups
from sparkdl.strategies.pipeline_transfer import (
    gather_rows,
    receive_stage,
    recv_tensor,
    scatter_rows,
    send_stages,
    send_tensor,
)
from sparkdl.strategies.rows import row_counts
from sparkdl.training.factory import build_model, build_on_meta, checkpoint_layers, tied_parameters
from sparkdl.training.precision import Precision as StepPrecision

#: ``(whole model, config, world) -> the index of each stage's first layer, and the end``
Cut = Callable[[nn.Module, SparkDLConfig, int], list[int]]


def _skeleton(model_fn: Callable[[], nn.Module]) -> nn.Sequential | None:
    """``model_fn``'s layers on the meta device, if a stage of them can be allocated alone and
    filled from rank 0's state dict (None: build them whole on every rank)."""
    try:
        skeleton = pipeline_layers(build_on_meta(model_fn))
    except ConfigError:
        raise
    except Exception:  # model_fn does something the meta device cannot
        return None
    state = skeleton.state_dict()
    unsaved = any(name not in state for name, _ in skeleton.named_buffers())
    if tied_parameters(skeleton) or unsaved or not all(isinstance(t, torch.Tensor) for t in state.values()):
        return None
    return skeleton


class StageModule(nn.Sequential):
    """This worker's stage: a run of the whole model's top-level layers, under their names
    in the whole model. Called, it runs the whole pipeline's forward on ``x`` together with
    the other stages of its pipeline (inference only); :meth:`run_layers` runs its own.

    ``model_names`` (a Hugging Face decoder's, whose layers name its tensors otherwise):
    each state key of the stage -> the model's key; None for an ``nn.Sequential``, whose
    names are the model's. A decoder's stage 0 takes the token ids and leaves their (boolean)
    padding mask behind (``drops_masks``): the rows are right-padded, which a causal mask
    makes harmless."""

    def __init__(
        self,
        layers: collections.OrderedDict[str, nn.Module],
        groups: PipelineGroups,
        whole_names: list[str],
        model_names: dict[str, str] | None = None,
        ties: list[Tie] | None = None,
    ) -> None:
        super().__init__(layers)
        self.groups = groups
        #: every parameter's name in the whole model, in its order (optimizer state's numbering)
        self.whole_parameter_names = whole_names
        own = list(self.state_dict())
        self.model_names = {key: (model_names or {}).get(key, key) for key in own}
        self.drops_masks = model_names is not None
        #: the ties that cross stages, and this stage's copy of each (None: it holds none)
        self.ties = ties or []
        local = dict(self.named_parameters())
        self.tied_copies = [next((local[n] for n in tie.names if n in local), None) for tie in self.ties]
        #: a tied copy's name here -> the name the whole model's parameters list it by
        self.aliases = {n: tie.names[0] for tie in self.ties for n in tie.names[1:] if n in local}
        #: the tied copies whose gradient another stage counts in the clipping norm (the first holder does)
        self.norm_skips = {
            n for tie in self.ties if tie.stages[0] != groups.stage for n in tie.names if n in local
        }
        #: the last collective forward's input and output on this stage (their shapes and dtypes
        #: are what the schedule's stage is built with)
        self.seen: tuple[torch.Tensor, torch.Tensor] | None = None

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, super().forward(x))

    def one_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """The one tensor stage 0 takes of a step's inputs (a decoder's without its masks).

        Raises:
            ConfigError: the inputs are more than one tensor.
        """
        given = [(f"positional {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
        taken = without_masks(given, self.drops_masks)
        if len(taken) != 1 or not isinstance(taken[0][1], torch.Tensor):
            names = [name for name, _ in taken]
            raise ConfigError(
                f"strategy = 'pipeline' feeds stage 0 one input tensor; the model got {len(names)} "
                f"({', '.join(names)}): join the inputs into one (feature_cols) or use another strategy"
            )
        return cast(torch.Tensor, taken[0][1])

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Every worker of the pipeline calls it with its own rows, at the same point; each
        gets the whole model's output for its rows."""
        x = self.one_input(args, kwargs)
        groups = self.groups
        device = x.device
        with torch.no_grad():
            counts = row_counts(len(x), groups.pipeline, device)
            rows = gather_rows(x, counts, groups.ranks[0], groups)
            if groups.first:
                received = cast(torch.Tensor, rows)
            else:
                received = recv_tensor(groups.ranks[groups.stage - 1], groups.pipeline, device)
            hidden = self.run_layers(received)
            self.seen = (received, hidden)
            if not groups.last:
                send_tensor(hidden, groups.ranks[groups.stage + 1], groups.pipeline)
            return scatter_rows(hidden if groups.last else None, counts, groups, device)


class StageLayers(nn.Module):
    """What the schedule runs on this worker: the stage's own layers, under autocast, with
    the bytes of the activations it sends counted."""

    def __init__(self, stage: StageModule, precision: StepPrecision) -> None:
        super().__init__()
        self.stage = stage
        self._precision = precision
        self.sent = 0  # bytes of activations sent on (forward) and of input gradients sent back

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._precision.autocast():
            out = self.stage.run_layers(x)
        groups = self.stage.groups
        self.sent += (0 if groups.last else out.nbytes) + (0 if groups.first else x.nbytes)
        return out


@dataclass(frozen=True)
class Tie:
    """A parameter the whole model holds under several names (a language model's embedding
    and its head) that the cut puts on several stages. Each of those stages trains a copy;
    their gradients are summed over them every step, so every copy takes the same step and
    they stay one tensor (Megatron's embedding group)."""

    names: tuple[str, ...]  # in the whole model; the first is the one its parameters list
    stages: tuple[int, ...]  # the stages holding a copy
    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool


def cross_stage_ties(whole: nn.Module, starts: list[int]) -> list[Tie]:
    """The tied parameters of ``whole`` whose layers the cut ``starts`` puts on more than
    one stage (a tie inside one stage stays one parameter there)."""
    index = {name: i for i, (name, _) in enumerate(whole.named_children())}
    stage_of = [s for s, (a, b) in enumerate(itertools.pairwise(starts)) for _ in range(a, b)]
    params = dict(whole.named_parameters(remove_duplicate=False))
    ties = []
    for names in tied_parameters(whole):
        stages = sorted({stage_of[index[name.split(".", 1)[0]]] for name in names})
        if len(stages) > 1:
            param = params[names[0]]
            shape, trainable = tuple(param.shape), param.requires_grad
            ties.append(Tie(tuple(names), tuple(stages), shape, param.dtype, trainable))
    return ties


def build_stage(
    model_fn: Callable[[], nn.Module], config: SparkDLConfig, device: torch.device, cut: Cut
) -> nn.Module:
    """This rank's stage on ``device``, and the pipeline's and the replicas' groups.

    Rank 0 builds the whole model (seeded, its random state restored after, as fsdp
    does) and sends each other rank its stage; the others build it on the meta device
    (no memory), allocate only their stage and receive it. So only rank 0 ever holds the
    whole model. A model whose stage could not be sent as it is built whole on every rank
    instead, as before: one with non-persistent buffers or non-tensor (extra) state,
    parameters it shares between layers (a stage allocated afresh would split them), or
    a model_fn the meta device cannot run."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    skeleton = _skeleton(model_fn)
    whole = skeleton if skeleton is not None and rank != 0 else None
    # rank 0 checks a decoder's layers against the model, as the driver's preflight (maybe off) does
    length = config.data.max_sequence_length
    if skeleton is None:
        built = build_model(model_fn)
        whole = checked_pipeline_layers(built, length) if rank == 0 else pipeline_layers(built)
    elif rank == 0:
        with torch.random.fork_rng(devices=[]):  # every rank leaves with the same random state
            whole = checked_pipeline_layers(build_model(model_fn), length)
    assert whole is not None
    starts = cut(whole, config, world)
    ties = cross_stage_ties(whole, starts)
    layout = Layout.of(config, world)
    tie_stages = sorted({stage for tie in ties for stage in tie.stages})
    groups = PipelineGroups.form(layout, rank, config.runtime.collective_timeout_s, tie_stages)
    children = list(whole.named_children())
    mine = children[starts[groups.stage] : starts[groups.stage + 1]]
    stage = StageModule(
        collections.OrderedDict(mine),
        groups,
        [name for name, _ in whole.named_parameters()],
        whole.model_names if isinstance(whole, DecoderLayers) else None,
        ties=ties,
    )
    if skeleton is not None and rank == 0:
        stages = [
            [f"{name}.{key}" for name, layer in children[a:b] for key in layer.state_dict()]
            for a, b in itertools.pairwise(starts)
        ]
        send_stages(whole.state_dict(), stages, layout.stage_of, device)
    elif skeleton is not None:
        stage.to_empty(device=device)
        receive_stage(stage.state_dict())
    del whole, skeleton, children, mine  # rank 0: the other stages' layers go now
    if config.training.activation_checkpointing:
        checkpoint_layers(stage)
    return stage.to(device)
