"""One worker of a full-batch fit (``optimizer = "lbfgs"``): the objective over its
partition, L-BFGS's vectors, checkpoints after iterations and the resume from them.

Assembled by :func:`sparkdl.worker.assembly.run_worker` in place of a strategy and the
step loop; the device, the process groups, the exchange, the feed and the progress
reporter are the same as every fit's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sparkdl.comm.exchange import Exchange
from sparkdl.config import DrillKind, FaultDrillSpec, LbfgsObjective, SparkDLConfig
from sparkdl.data.columns import LabelKind
from sparkdl.data.feed import PartitionFeed
from sparkdl.errors import CheckpointError, SparkDLError, agreed
from sparkdl.services.ps.client import PsClient, RunFinished
from sparkdl.storage.checkpoint_store import CheckpointStore
from sparkdl.training.factory import cpu_state_dict
from sparkdl.training.full_batch import FullBatchTrainer, Objective, Saved, check_finite, flat_gradient
from sparkdl.training.full_batch_settings import lbfgs_settings
from sparkdl.training.guards import LabelRangeCheck, fire_drill, no_label_check
from sparkdl.training.hooks import ProgressUpdate
from sparkdl.training.losses import LossFn, resolve_loss
from sparkdl.training.precision import Precision
from sparkdl.training.validation import Validator

log = logging.getLogger(__name__)


def full_batch_trainer(
    config: SparkDLConfig,
    loss: str | LossFn,
    keyword: bool,
    label_name: str,
    rank: int,
    module: torch.nn.Module,
    exchange: Exchange,
    feed: PartitionFeed,
    validation: bool,
    store: CheckpointStore | None,
    send: Callable[[ProgressUpdate], None] | None,
    served: PsClient | None = None,
) -> FullBatchTrainer | ServedPasses:
    """The L-BFGS run of this worker, resumed from the newest checkpoint where there is one;
    with a parameter server (``served``), the passes its coordinator asks for.

    Args:
        config: the fit's settings.
        loss: the loss by name or the user's callable.
        keyword: the model takes its inputs by name.
        label_name: the label column, for messages.
        rank: this worker.
        module: the bare model on its device (the same weights on every rank).
        exchange: the worker's sums with the others.
        feed: the partition, pass after pass.
        validation: the feed holds rows out to validate.
        store: the checkpoint directory (None: no checkpoints): rank 0 writes one every
            ``checkpoint_every`` iterations (every iteration when it is 0).
        send: reports progress to the driver (None: nobody listens).
        served: this worker's client of the parameter server whose shards hold the vectors
            (strategy parameter_server; None: every worker holds them).
    """
    device = next(module.parameters()).device
    for tensor in [*module.parameters(), *module.buffers()]:
        exchange.broadcast_(tensor.data)  # every rank starts from rank 0's weights
    loss_fn, label_kind = resolve_loss(loss)
    check_labels = (
        LabelRangeCheck(module, device, rank, label_name, keyword)
        if label_kind is LabelKind.CLASS_INDEX
        else no_label_check
    )
    objective = Objective(
        module,
        feed,
        loss_fn,
        keyword,
        exchange,
        config.optimizer.weight_decay,
        check_labels,
        Precision(config.training.precision, device),
        rank,
        spark=config.lbfgs.objective is LbfgsObjective.SPARK,
    )
    if served is not None:
        return ServedPasses(objective, served, module, rank, config.reliability.drill)
    validate = None
    if validation:
        validator = Validator(
            lambda: feed.validation_batches(config.data.inference_batch_size),
            loss_fn,
            label_kind,
            keyword,
            device,
            exchange.control,
        )
        validate = lambda: validator.evaluate(module)  # noqa: E731
    resumed = _resume(store, rank, module, exchange, device)
    after = _after_iteration(config, rank, module, objective, store, send)
    return FullBatchTrainer(lbfgs_settings(config), objective, exchange, resumed, validate, after)


def _after_iteration(
    config: SparkDLConfig,
    rank: int,
    module: torch.nn.Module,
    objective: Objective,
    store: CheckpointStore | None,
    send: Callable[[ProgressUpdate], None] | None,
) -> Callable[[Saved], None]:
    every = max(config.reliability.checkpoint_every, 1)
    drill = config.reliability.drill
    started = time.perf_counter()

    def after(saved: Saved) -> None:
        iteration = saved.state.iteration
        record = saved.history[-1]
        if send is not None:
            rows = objective.rows
            send(
                ProgressUpdate(
                    iteration, 1, 1, rows, record["loss"] * rows, time.perf_counter() - started,
                    record.get("val_loss"),
                )
            )  # fmt: skip
        if store is not None:
            store.record_progress(iteration)
            if rank == 0 and iteration % every == 0:
                _save(store, iteration, module, saved)
        if drill is not None and drill.kind is not DrillKind.SLOW:
            fire_drill(drill, rank, iteration, module)  # the drill's step counts iterations here

    return after


def _save(store: CheckpointStore, iteration: int, module: torch.nn.Module, saved: Saved) -> None:
    store.save(
        iteration,
        {
            "format": 1,
            "model": cpu_state_dict(module),
            "optimizer": {},
            "epoch": iteration + 1,
            "epoch_steps_done": 0,
            "global_steps_done": iteration,
            "history": json.dumps(saved.history),
            "full_batch": saved.to_dict(),
        },
    )


def _resume(
    store: CheckpointStore | None,
    rank: int,
    module: torch.nn.Module,
    exchange: Exchange,
    device: torch.device,
) -> Saved | None:
    """The run of the newest checkpoint, put back in place (every rank loads the one rank 0
    chose); None on a fresh start."""
    if store is None:
        return None
    latest = store.latest() if rank == 0 else None
    chosen = torch.tensor([-1 if latest is None else latest], dtype=torch.int64)
    if exchange.world_size > 1:
        dist.broadcast(chosen, src=0, group=exchange.control)
    iteration = int(chosen.item())
    if iteration < 0:
        return None
    state = store.load(iteration)
    if "full_batch" not in state:
        raise CheckpointError(
            f"checkpoint {store.path_for(iteration)} was written by a fit that trained in steps, not "
            "by optimizer = 'lbfgs'; resume it with the optimizer that wrote it, or use a new "
            "checkpoint_dir"
        )
    module.load_state_dict(state["model"])
    log.info("rank %d resumed L-BFGS after iteration %d", rank, iteration)
    return Saved.from_dict(state["full_batch"], device)


class ServedPasses:
    """A worker of a full-batch fit whose L-BFGS runs on the driver (strategy parameter_server):
    it computes passes, nothing else. Each pull brings the point to evaluate; each push
    carries this worker's summed gradient (shard by shard) and summed loss; a pull answered
    FINISHED ends the run.

    Args:
        objective: the passes over this worker's partition.
        client: this worker's connections to the shards.
        module: the model (its parameters in the shards' order through ``shard_params``).
        rank: this worker, for messages.
        drill: the fault drill (its step counts passes here).
    """

    def __init__(
        self,
        objective: Objective,
        client: PsClient,
        module: torch.nn.Module,
        rank: int,
        drill: FaultDrillSpec | None = None,
    ) -> None:
        self._objective = objective
        self._client = client
        self._module = module
        self._drill = drill
        params = list(module.parameters())
        self._shards = [[params[i] for i in shard] for shard in client.endpoint.shard_params]
        self._rank = rank

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self._objective.output_shape

    @property
    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        return self._objective.input_shapes

    def run(self) -> list[dict[str, Any]]:
        """Compute passes until the coordinator stops; the history is the driver's. A failure
        here is told to the server first, so that the other workers stop at their next pull
        instead of waiting for this one's push."""
        try:
            self._passes()
        except RunFinished:
            return []
        except SparkDLError as exc:
            if not getattr(exc, "agreed_by_all_ranks", False):  # an agreed stop is every rank's already
                self._tell_server(exc)
            raise
        except BaseException as exc:
            self._tell_server(exc)
            raise
        return []

    def _tell_server(self, exc: BaseException) -> None:
        try:
            self._client.abort(f"{type(exc).__name__}: {exc}")
        except Exception:  # the server may be what failed: the original error wins
            log.warning("rank %d could not tell the parameter server that it stopped", self._rank)

    def _passes(self) -> None:
        clock = 0
        while True:
            pulled = self._client.pull(clock)
            if self._drill is not None and self._drill.kind is not DrillKind.SLOW:
                fire_drill(self._drill, self._rank, clock, self._module)  # the drill's step: a pass
            with torch.no_grad():
                for shard, (_, weights) in zip(self._shards, pulled, strict=True):
                    offset = 0
                    for p in shard:
                        p.copy_(weights[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()
            loss_sum, rows, rejected = self._objective.local_pass()
            if rejected is not None:
                self._tell_server(rejected)
                raise agreed(rejected)
            gradients = [flat_gradient(shard).cpu() for shard in self._shards]
            try:  # this worker's sums already make the objective non-finite: stop every rank now
                for gradient in gradients:
                    check_finite(loss_sum, gradient, clock + 1)
            except SparkDLError as exc:
                self._tell_server(exc)
                raise
            self._client.push(clock, rows, gradients, loss_sum)
            clock += 1
