"""A fit that starts from a trained model's weights (``TorchEstimator(initial_model=...)``):
the daily retraining on new partitions continues from yesterday's model instead of from
``model_fn``'s fresh weights.

The weights travel as ``transform``'s do (:func:`sparkdl.spark.inference.model_weights`):
offered by the driver's weights server and fetched once per Python worker, not shipped in
the task's closure. The fit's ``model_fn`` is wrapped (:class:`WarmStart`), so every place
that builds the model (each worker, whatever the strategy; the parameter server on the
driver; the preflight) builds it with these weights. A skeleton built on the meta device
(fsdp's and the loader's) is left as it is: the whole model it is filled from was built
through the same wrapper.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sparkdl.errors import ConfigError, listed
from sparkdl.spark.inference import ModelWeights
from sparkdl.training.factory import ModelFn

_CACHE: dict[str, dict[str, torch.Tensor]] = {}  # one entry: this process's newest warm start
_CACHE_LOCK = threading.Lock()


@dataclass(frozen=True)
class WarmStart:
    """``model_fn``, then the weights of ``source`` loaded into what it built.

    Attributes:
        model_fn: the fit's own.
        weights: where the starting weights are fetched from.
        source: what they are, for the model's lineage (a path, or a model's uid).
    """

    model_fn: ModelFn
    weights: ModelWeights
    source: str

    def __call__(self) -> nn.Module:
        module = self.model_fn()
        if not isinstance(module, nn.Module) or any(p.is_meta for p in module.parameters()):
            return module  # build_model says what is wrong; a skeleton gets its weights later
        result = module.load_state_dict(self._state(), strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise ConfigError(
                f"initial_model ({self.source}) does not fit model_fn's model: "
                f"{len(result.missing_keys)} of the model's tensors are not in it "
                f"({listed(result.missing_keys)}), {len(result.unexpected_keys)} of its tensors are not "
                f"the model's ({listed(result.unexpected_keys)}); start from a model that model_fn builds"
            )
        return module

    def _state(self) -> dict[str, torch.Tensor]:
        with _CACHE_LOCK:
            if self.weights.key not in _CACHE:
                _CACHE.clear()
                _CACHE[self.weights.key] = self.weights.load()
            return _CACHE[self.weights.key]


def warm_start(spark: Any, model_fn: ModelFn, module: nn.Module, source: str, encrypt: bool) -> WarmStart:
    """The ``model_fn`` of a fit that starts from ``module``'s weights (``source`` names them
    for the lineage), offered to the tasks from the driver's weights server (the encrypting
    one with ``encrypt``)."""
    from sparkdl.spark.inference import model_weights

    return WarmStart(model_fn, model_weights(spark, module, encrypt), source)
