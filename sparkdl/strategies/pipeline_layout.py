"""Where a pipeline runs: the cut into stages (:func:`balance` by parameters, or
:func:`stage_starts` at the layers named), the layout of stages and replicas over the ranks
(:class:`Layout`, DistBelief's), and their process groups (:class:`PipelineGroups`). Pure
logic but for the groups."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from sparkdl.config import SparkDLConfig
from sparkdl.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """``stages`` consecutive ranks per pipeline, ``replicas`` pipelines."""

    stages: int
    replicas: int

    @classmethod
    def of(cls, config: SparkDLConfig, world_size: int) -> Layout:
        stages = config.pipeline.stages or world_size
        return cls(stages, world_size // stages)

    def stage_of(self, rank: int) -> int:
        return rank % self.stages

    def replica_of(self, rank: int) -> int:
        return rank // self.stages

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The ranks of one pipeline, stage by stage."""
        return [replica * self.stages + s for s in range(self.stages)]

    def replica_ranks(self, stage: int) -> list[int]:
        """The ranks that run ``stage``, one per pipeline."""
        return [r * self.stages + stage for r in range(self.replicas)]


def balance(costs: Sequence[int], parts: int) -> list[int]:
    """Where each of ``parts`` contiguous, non-empty runs of ``costs`` starts, so that the
    costliest run costs as little as it can. Among equal cuts the latest: a layer without
    parameters (an activation) stays with the layer before it."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty stages")
    prefix = list(itertools.accumulate(costs, initial=0))
    inf = float("inf")
    # best[k][i]: the least possible largest run when the first i layers make k runs
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst <= best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def stage_starts(
    names: Sequence[str], costs: Sequence[int], stages: int, split_before: Sequence[str]
) -> list[int]:
    """The index of each stage's first layer: given by name, or balanced by ``costs``.

    Raises:
        ConfigError: a name is not a layer, the names are out of order, or there are not
            ``stages - 1`` of them.
    """
    if len(names) < stages:
        raise ConfigError(
            f"the model has {len(names)} top-level layers ({', '.join(names)}); it cannot be cut into "
            f"{stages} stages: set pipeline.stages to at most {len(names)}, or make the model an "
            "nn.Sequential of more layers"
        )
    if not split_before:
        return balance(costs, stages)
    if len(split_before) != stages - 1:
        raise ConfigError(
            f"pipeline.split_before names {len(split_before)} layers, {list(split_before)}; {stages} stages "
            f"need {stages - 1} (the first layer of each stage after the first)"
        )
    position = {name: i for i, name in enumerate(names)}
    missing = [name for name in split_before if name not in position]
    if missing:
        raise ConfigError(
            f"pipeline.split_before names {missing}, not top-level layers of the model; its layers are "
            f"{', '.join(names)}"
        )
    starts = [0] + [position[name] for name in split_before]
    if any(b <= a for a, b in itertools.pairwise(starts)):
        raise ConfigError(
            f"pipeline.split_before = {list(split_before)} must name layers in the model's order, after "
            f"its first layer ({names[0]!r}), each once"
        )
    return starts


# ------------------------------------------------------------------ groups and the stage


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's place in the layout and the process groups it talks in."""

    layout: Layout
    rank: int
    pipeline: dist.ProcessGroup  # this rank's pipeline, stage by stage
    replicas: dist.ProcessGroup | None  # this rank's stage over every pipeline (None: one pipeline)
    objects: dist.ProcessGroup  # gloo over this rank's pipeline: pickled state dicts
    #: the stages of this rank's pipeline that hold copies of tied parameters (None: it holds none)
    ties: dist.ProcessGroup | None = None

    @property
    def stage(self) -> int:
        return self.layout.stage_of(self.rank)

    @property
    def ranks(self) -> list[int]:
        return self.layout.pipeline_ranks(self.layout.replica_of(self.rank))

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.layout.stages - 1

    @classmethod
    def form(
        cls, layout: Layout, rank: int, timeout_s: float, tie_stages: Sequence[int] = ()
    ) -> PipelineGroups:
        """Every rank creates every group, in the same order (``new_group``'s rule), each
        bounded by ``timeout_s`` (``runtime.collective_timeout_s``). ``tie_stages``: the
        stages that hold copies of tied parameters, which sum their gradients each step."""
        gloo = dist.get_backend() == "gloo"
        timeout = timedelta(seconds=timeout_s)
        own = layout.replica_of(rank)
        pipeline = objects = replicas = None
        for replica in range(layout.replicas):
            ranks = layout.pipeline_ranks(replica)
            group = dist.new_group(ranks, timeout=timeout)
            group_objects = group if gloo else dist.new_group(ranks, backend="gloo", timeout=timeout)
            if replica == own:
                pipeline, objects = group, group_objects
        if layout.replicas > 1:
            for stage in range(layout.stages):
                group = dist.new_group(layout.replica_ranks(stage), timeout=timeout)
                if stage == layout.stage_of(rank):
                    replicas = group
        ties = None
        if len(tie_stages) > 1:
            for replica in range(layout.replicas):
                holders = [layout.pipeline_ranks(replica)[stage] for stage in tie_stages]
                group = dist.new_group(holders, timeout=timeout)
                if rank in holders:
                    ties = group
        assert pipeline is not None and objects is not None
        return cls(layout, rank, pipeline, replicas, objects, ties)
