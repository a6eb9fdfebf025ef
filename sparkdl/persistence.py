"""Spark ML persistence of :class:`~sparkdl.estimator.TorchModel` and
:class:`~sparkdl.estimator.TorchEstimator`: settings as Spark ML metadata, weights as a
``weights_only`` torch file, user functions cloudpickled (load only what you trust).

The weights file is written by ``torch.save`` straight to a file and loaded memory-mapped
into a module built on the meta device, so saving or loading a model of N bytes holds
about N bytes, not two or three copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import cloudpickle
import torch
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from sparkdl.runtime import fs
from sparkdl.training.factory import cpu_state_dict, module_with_state

if TYPE_CHECKING:
    from sparkdl.estimator import TorchEstimator, TorchModel


class TorchModelWriter(MLWriter):
    """Saves params as Spark ML metadata, weights as a ``weights_only`` torch file."""

    def __init__(self, instance: TorchModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        model = self.instance
        extra = {
            "history": model.history,
            "output_shape": list(model.output_shape),
            "trained_input_shapes": {name: list(shape) for name, shape in model.trained_input_shapes.items()},
            "classifier": model.classifier,
            "transform_fn": model.transform_fn is not None,
        }
        DefaultParamsWriter.saveMetadata(model, path, self.sparkSession, extraMetadata=extra)
        assert model.module is not None
        state = cpu_state_dict(model.module)
        fs.write_file(self.sparkSession, f"{path}/weights.pt", lambda file: torch.save(state, file))
        fs.write_bytes(self.sparkSession, f"{path}/model_fn.cloudpickle", cloudpickle.dumps(model.model_fn))
        if model.transform_fn is not None:
            data = cloudpickle.dumps(model.transform_fn)
            fs.write_bytes(self.sparkSession, f"{path}/transform_fn.cloudpickle", data)


def _legacy_shapes(metadata: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """A model saved before named inputs recorded one ``input_shape``: feature_cols' matrix."""
    shape = metadata.get("input_shape")
    return {"features": tuple(shape)} if shape else {}


class TorchModelReader(MLReader):
    """Loads a TorchModel. The model factory (and transform_fn) is unpickled: load only
    models you trust."""

    def load(self, path: str) -> TorchModel:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        model_fn = cloudpickle.loads(fs.read_bytes(self.sparkSession, f"{path}/model_fn.cloudpickle"))
        with fs.local_file(self.sparkSession, f"{path}/weights.pt") as file:
            # memory-mapped: the weights are read from the file as they are used, not copied
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        transform_fn = None
        if metadata.get("transform_fn"):
            transform_fn = cloudpickle.loads(
                fs.read_bytes(self.sparkSession, f"{path}/transform_fn.cloudpickle")
            )
        from sparkdl.estimator import TorchModel

        module = module_with_state(model_fn, state)
        model = TorchModel(
            module=module,
            model_fn=model_fn,
            history=metadata["history"],
            output_shape=tuple(metadata["output_shape"]),
            classifier=metadata["classifier"],
            trained_input_shapes=metadata.get("trained_input_shapes") or _legacy_shapes(metadata),
            transform_fn=transform_fn,
        )
        model._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(model, metadata)
        return model


class TorchEstimatorWriter(MLWriter):
    """Saves an unfitted estimator (e.g. inside a saved Pipeline or CrossValidatorModel):
    its settings as Spark ML metadata and its functions cloudpickled."""

    def __init__(self, instance: TorchEstimator) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession)
        # every user function (model_fn, optimizer_fn, loss_fn, ...): what is not a Param
        functions = {name: value for name, value in vars(self.instance).items() if name.endswith("_fn")}
        fs.write_bytes(self.sparkSession, f"{path}/functions.cloudpickle", cloudpickle.dumps(functions))


class TorchEstimatorReader(MLReader):
    """Loads a TorchEstimator. Its functions are unpickled: load only estimators you trust."""

    def load(self, path: str) -> TorchEstimator:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        functions = cloudpickle.loads(fs.read_bytes(self.sparkSession, f"{path}/functions.cloudpickle"))
        from sparkdl.estimator import TorchEstimator

        estimator = TorchEstimator()
        for name, value in functions.items():
            setattr(estimator, name, value)
        estimator._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(estimator, metadata)
        return estimator
