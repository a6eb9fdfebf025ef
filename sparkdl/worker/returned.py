"""What a user's own code returns on rank 0, on its way to the driver: shared by
``sparkdl.run`` (:mod:`sparkdl.worker.own_loop`) and the TorchDistributor
(:mod:`sparkdl.worker.distributor_agent`, :mod:`sparkdl.worker.child`).

A dict of tensors (a state dict) travels as tensors: to the driver's weights server where
it listens (no pickle, no JVM), else in the result rows, loaded ``weights_only``; anything
else is cloudpickled, as PySpark's distributor returns it. Light to import (torch and the
weights client load when used): the distributor's child process imports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from sparkdl.services.weights.endpoint import WeightsEndpoint

log = logging.getLogger(__name__)


@dataclass
class Returned:
    """What a run brought back: rank 0's value, in one of two forms.

    Attributes:
        pickled: cloudpickle bytes of the value (b"": a state dict, or a script's None).
        state_dict: the value, when it was a dict of tensors (None otherwise).
        uploaded: rank 0 sent its state dict to the driver's weights server.
    """

    pickled: bytes = b""
    state_dict: dict[str, torch.Tensor] | None = None
    uploaded: bool = False


def is_state_dict(value: Any) -> bool:
    """Whether ``value`` is a non-empty dict of named tensors (what ``state_dict()`` returns)."""
    if not isinstance(value, dict) or not value:
        return False
    import torch

    return all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())


def cpu_state(value: dict[str, Any]) -> dict[str, Any]:
    """A returned state dict as contiguous CPU tensors, detached from any graph."""
    return {k: v.detach().cpu().contiguous() for k, v in value.items()}


def returned_value(value: Any, weights: WeightsEndpoint | None) -> Returned:
    """Rank 0's return value for the driver: a state dict through the weights server (no
    pickle, no JVM) where it listens, else as tensors; anything else cloudpickled."""
    if is_state_dict(value):
        return returned_state(cpu_state(value), weights)
    if value is None:
        return Returned()
    import cloudpickle

    return Returned(pickled=cloudpickle.dumps(value))


def returned_state(state: dict[str, torch.Tensor], weights: WeightsEndpoint | None) -> Returned:
    """A returned state dict (CPU tensors): sent to the driver's weights server (no pickle,
    no JVM) where it listens, else kept for the result rows."""
    if weights is None:
        return Returned(state_dict=state)
    from sparkdl.services.weights.client import upload

    sent = upload(weights, state)
    log.info("rank 0 sent its returned state dict (%.1f MB) to the driver", sent / 1e6)
    return Returned(uploaded=True)
