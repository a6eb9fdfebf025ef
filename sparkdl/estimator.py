"""``TorchEstimator`` and ``TorchModel``: distributed PyTorch training as a pyspark.ml stage.

Every setting of :class:`sparkdl.config.SparkDLConfig` is a Spark ML ``Param`` of
the same name (generated from the dataclasses, so the two never drift apart), so
estimators work with ``Pipeline``, ``ParamGridBuilder`` and ML persistence.
"""

from __future__ import annotations

import enum
import functools
import time
import typing
from pathlib import Path
from typing import Any

import cloudpickle
import torch
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import (
    DefaultParamsReader,
    DefaultParamsWriter,
    MLReadable,
    MLReader,
    MLWritable,
    MLWriter,
)

from sparkdl.config import (
    DEFAULT_LOSS,
    SECTIONS,
    SparkDLConfig,
    check_setting_names,
    flat_field_owners,
    load_config,
)
from sparkdl.errors import ConfigError
from sparkdl.runtime import fs
from sparkdl.runtime.driver import plan_columns, run_training
from sparkdl.runtime.inference import PredictSpec, output_mode, predict_partition, prediction_schema
from sparkdl.runtime.worker import TrainSpec
from sparkdl.settings import library_settings, param_doc, with_settings_section
from sparkdl.tracking import log_fit
from sparkdl.training.factory import ModelFn, OptimizerFn, build_model, state_from_bytes, state_to_bytes
from sparkdl.training.losses import LossFn, resolve_loss

_DEFAULTS = SparkDLConfig().flat()


def _converter(hint: Any) -> Any:
    if typing.get_origin(hint) is tuple:
        return TypeConverters.toListString
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return lambda v: TypeConverters.toString(v.value if isinstance(v, enum.Enum) else v)
    return {
        int: TypeConverters.toInt,
        float: TypeConverters.toFloat,
        bool: TypeConverters.toBoolean,
        str: TypeConverters.toString,
    }[hint]


def _config_params() -> dict[str, Param]:
    """One Param per setting; its doc is the setting's row of the settings table."""
    params = {}
    for setting in library_settings():
        hint = typing.get_type_hints(SECTIONS[setting.section])[setting.name]
        params[setting.name] = Param(
            Params._dummy(), setting.name, param_doc(setting), typeConverter=_converter(hint)
        )
    return params


def choose_loss(loss_fn: str | LossFn | None, loss: str) -> str | LossFn:
    """The one loss of a fit, from the ``loss_fn`` argument and the ``loss`` setting.

    ``loss_fn`` (a name or a callable) wins when ``loss`` is left at its default or
    names the same loss; without ``loss_fn``, ``loss`` is the loss.

    Raises:
        ConfigError: both are given and name different losses (the message says which to drop).
    """
    if loss_fn is None:
        return loss
    if loss == DEFAULT_LOSS or (isinstance(loss_fn, str) and loss_fn == loss):
        return loss_fn
    shown = loss_fn if isinstance(loss_fn, str) else getattr(loss_fn, "__name__", type(loss_fn).__name__)
    raise ConfigError(
        f"loss_fn = {shown!r} and the setting loss = {loss!r} name different losses; drop one: "
        f"remove loss = {loss!r} (keyword, [training] loss in the config file, or --set "
        "training.loss) to train with loss_fn, or drop loss_fn to train with the setting"
    )


class _SparkDLParams(Params):
    """Params shared by the estimator and the model: one per config setting."""

    def _init_defaults(self) -> None:
        self._setDefault(**{k: list(v) if isinstance(v, tuple) else v for k, v in _DEFAULTS.items()})

    def _apply_settings(self, config: SparkDLConfig | str | Path | None, settings: dict[str, Any]) -> None:
        if config is not None:
            loaded = config if isinstance(config, SparkDLConfig) else load_config(config)
            self._set(**{k: list(v) if isinstance(v, tuple) else v for k, v in loaded.flat().items()})
        check_setting_names(settings)
        self.get_config().replace(**settings)  # validate values and cross-field rules now
        self._set(**{k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()})

    def get_config(self) -> SparkDLConfig:
        """The settings of this stage as a validated :class:`SparkDLConfig`."""
        values = {name: self.getOrDefault(name) for name in flat_field_owners()}
        return SparkDLConfig().replace(**values)


for _name, _param in _config_params().items():
    setattr(_SparkDLParams, _name, _param)


class TorchEstimator(Estimator, _SparkDLParams):
    """Trains a PyTorch model on a Spark DataFrame with one barrier task per worker.

    Args:
        model_fn: ``() -> torch.nn.Module``, called on every worker (cloudpickled).
        optimizer_fn: ``(params) -> torch.optim.Optimizer``; default: ``[optimizer]`` settings.
        loss_fn: "cross_entropy", "mse", "bce_with_logits", or ``callable(output, target)``
            returning the mean loss (it then gets float32 targets). Overrides the ``loss``
            setting only while that is at its default or names the same loss.
        config: a :class:`SparkDLConfig` or the path of a TOML file; keyword settings
            override it.
        **settings: any setting of :class:`SparkDLConfig` by name, e.g. ``num_workers=2,
            batch_size=64, epochs=5, seed=0, strategy="allreduce", feature_cols=["x"]``.

    Raises:
        ConfigError: an unknown setting, a value of the wrong type or range, or a
            ``loss_fn`` that contradicts the ``loss`` setting.
    """

    def __init__(
        self,
        model_fn: ModelFn | None = None,
        optimizer_fn: OptimizerFn | None = None,
        loss_fn: str | LossFn | None = None,
        config: SparkDLConfig | str | Path | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        self._init_defaults()
        self._apply_settings(config, settings)
        chosen = choose_loss(loss_fn, self.get_config().training.loss)
        if isinstance(chosen, str):  # a named loss is the setting, so Params and persistence show it
            self._apply_settings(None, {"loss": chosen})
        self.model_fn = model_fn
        self.optimizer_fn = optimizer_fn
        self.loss_fn: LossFn | None = None if isinstance(chosen, str) else chosen

    def _loss(self) -> str | LossFn:
        return choose_loss(self.loss_fn, self.get_config().training.loss)

    def _fit(self, dataset: Any) -> TorchModel:
        if self.model_fn is None:
            raise ConfigError("TorchEstimator needs model_fn: a function that builds the torch.nn.Module")
        config = self.get_config()
        loss = self._loss()
        _, label_kind = resolve_loss(loss)
        plan = plan_columns(dataset, config.data.feature_cols, config.data.label_col, label_kind)
        spec = TrainSpec(config, self.model_fn, self.optimizer_fn, loss, plan)
        started = time.perf_counter()
        result = run_training(dataset, spec)
        module = build_model(self.model_fn)
        module.load_state_dict(result.state_dict)
        model = TorchModel(
            module=module,
            model_fn=self.model_fn,
            history=result.history,
            output_shape=result.output_shape,
            classifier=isinstance(loss, str) and loss == "cross_entropy",
            input_shape=result.input_shape,
        )
        model.worker_rows = result.worker_rows
        model.worker_devices = result.worker_devices
        model.bad_rows_skipped = result.bad_rows_skipped
        model = self._copyValues(model)
        model.mlflow_run_id = log_fit(config, model, time.perf_counter() - started)
        return model


TorchEstimator.__doc__ = with_settings_section(TorchEstimator.__doc__)


class TorchModel(Model, _SparkDLParams, MLWritable, MLReadable):
    """A trained model: ``transform`` adds predictions, computed on the executors.

    Attributes:
        module: the trained ``torch.nn.Module`` (on CPU).
        history: one dict per epoch with at least epoch, loss, samples, seconds.
    """

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        model_fn: ModelFn | None = None,
        history: list[dict[str, Any]] | None = None,
        output_shape: tuple[int, ...] = (),
        classifier: bool = False,
        input_shape: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self._init_defaults()
        self.module = module
        self.model_fn = model_fn
        self.history = list(history or [])
        self.output_shape = tuple(output_shape)
        self.input_shape = tuple(input_shape)
        self.classifier = classifier
        self.worker_rows: list[int] = []
        self.worker_devices: list[dict[str, Any]] = []  # per rank: device and Spark-assigned GPUs
        self.bad_rows_skipped = 0  # rows dropped by on_bad_rows = "skip"
        self.mlflow_run_id: str | None = None  # the MLflow run fit logged to, if any

    def _transform(self, dataset: Any) -> Any:
        if self.module is None or self.model_fn is None:
            raise ConfigError("this TorchModel holds no trained module; fit or load one first")
        config = self.get_config()
        plan = plan_columns(dataset, config.data.feature_cols, None, resolve_loss("mse")[1])
        mode = output_mode(self.classifier, self.output_shape)
        spec = PredictSpec(
            model_fn=self.model_fn,
            state=state_to_bytes(self.module),
            plan=plan,
            prediction_col=config.data.prediction_col,
            mode=mode,
            batch_size=config.data.inference_batch_size,
            use_gpu=config.runtime.use_gpu,
            torch_threads=config.runtime.torch_threads,
        )
        schema = prediction_schema(dataset.schema, config.data.prediction_col, mode)
        return dataset.mapInArrow(functools.partial(predict_partition, spec), schema)

    def plot_history(self, path: str | Path) -> Path:
        """Write a PNG of the loss and samples/s per epoch (job and each worker) to ``path``."""
        from sparkdl.plots import plot_history

        return plot_history(self.history, path, title=f"sparkdl fit: {self.getOrDefault('strategy')}")

    def write(self) -> MLWriter:
        return _TorchModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return _TorchModelReader()


class _TorchModelWriter(MLWriter):
    """Saves params as Spark ML metadata, weights as a ``weights_only`` torch file."""

    def __init__(self, instance: TorchModel) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        model = self.instance
        extra = {
            "history": model.history,
            "output_shape": list(model.output_shape),
            "input_shape": list(model.input_shape),
            "classifier": model.classifier,
        }
        DefaultParamsWriter.saveMetadata(model, path, self.sparkSession, extraMetadata=extra)
        assert model.module is not None
        fs.write_bytes(self.sparkSession, f"{path}/weights.pt", state_to_bytes(model.module))
        fs.write_bytes(self.sparkSession, f"{path}/model_fn.cloudpickle", cloudpickle.dumps(model.model_fn))


class _TorchModelReader(MLReader):
    """Loads a TorchModel. The model factory is unpickled: load only models you trust."""

    def load(self, path: str) -> TorchModel:
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        model_fn = cloudpickle.loads(fs.read_bytes(self.sparkSession, f"{path}/model_fn.cloudpickle"))
        state = state_from_bytes(fs.read_bytes(self.sparkSession, f"{path}/weights.pt"))
        module = build_model(model_fn)
        module.load_state_dict(state)
        model = TorchModel(
            module=module,
            model_fn=model_fn,
            history=metadata["history"],
            output_shape=tuple(metadata["output_shape"]),
            classifier=metadata["classifier"],
            input_shape=tuple(metadata.get("input_shape", ())),
        )
        model._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(model, metadata)
        return model
