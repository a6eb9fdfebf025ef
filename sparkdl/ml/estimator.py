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

import torch
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import (
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
from sparkdl.config.table import library_settings, param_doc, with_settings_section
from sparkdl.data.columns import LabelKind
from sparkdl.data.inputs import TransformFn
from sparkdl.errors import ConfigError
from sparkdl.ml.persistence import (
    TorchEstimatorReader,
    TorchEstimatorWriter,
    TorchModelReader,
    TorchModelWriter,
)
from sparkdl.spark.driver import plan_inputs, run_training, token_input, vectors_as_arrays, with_validation
from sparkdl.spark.inference import (
    OutputCols,
    PredictSpec,
    model_weights,
    output_mode,
    predict_partition,
    prediction_schema,
)
from sparkdl.spark.rdd import is_rdd, rdd_to_dataframe
from sparkdl.spark.shipping import check_shippable
from sparkdl.spark.storage import with_spark_storage_options
from sparkdl.spark.tracking import check_tracking, log_fit
from sparkdl.spark.warm_start import WarmStart, warm_start
from sparkdl.strategies import check_settings
from sparkdl.strategies.tensor_plan import check_parallelize_fn
from sparkdl.training.factory import ModelFn, OptimizerFn, ParallelizeFn, module_with_state
from sparkdl.training.full_batch_settings import check_full_batch_inputs
from sparkdl.training.losses import LossFn, resolve_loss, takes_weight
from sparkdl.training.schedules import lr_plan
from sparkdl.training.strategy import SchedulerFn
from sparkdl.worker.assembly import TrainSpec

_DEFAULTS = SparkDLConfig().flat()


def _converter(hint: Any) -> Any:
    if typing.get_origin(hint) is tuple:
        return TypeConverters.toListString
    if typing.get_origin(hint) is dict:
        return _to_table
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return lambda v: TypeConverters.toString(v.value if isinstance(v, enum.Enum) else v)
    return {
        int: TypeConverters.toInt,
        float: TypeConverters.toFloat,
        bool: TypeConverters.toBoolean,
        str: TypeConverters.toString,
    }[hint]


def _to_table(value: Any) -> dict[str, Any]:
    """A table setting as a Param value: a dict whose lists are lists (JSON-persistable)."""
    if not isinstance(value, dict):
        raise TypeError(f"expected a dict, got {type(value).__name__}")
    return {str(k): list(v) if isinstance(v, tuple) else v for k, v in value.items()}


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
        check_settings(self._settings().replace(**settings))  # values and the strategy's rules, now
        self._set(**{k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()})

    def get_config(self) -> SparkDLConfig:
        """The settings of this stage as a validated :class:`SparkDLConfig`.

        Raises:
            ConfigError: a value, or a combination the chosen strategy cannot run with
                (after ``set`` or ``copy(extra)``, which Spark's Params do not validate).
        """
        return check_settings(self._settings())

    def _settings(self) -> SparkDLConfig:
        values = {name: self.getOrDefault(name) for name in flat_field_owners()}
        return SparkDLConfig().replace(**values)


for _name, _param in _config_params().items():
    setattr(_SparkDLParams, _name, _param)


class TorchEstimator(Estimator, _SparkDLParams, MLWritable, MLReadable):
    """Trains a PyTorch model on a Spark DataFrame with one barrier task per worker.

    Args:
        model_fn: ``() -> torch.nn.Module``, called on every worker (cloudpickled).
        optimizer_fn: ``(params) -> torch.optim.Optimizer``; default: ``[optimizer]`` settings.
        loss_fn: "cross_entropy", "mse", "bce_with_logits", "causal_lm" (a language model's
            next token of its sequence input: no label column), or ``callable(output, target)``
            returning the mean loss (it then gets float32 targets). Overrides the ``loss``
            setting only while that is at its default or names the same loss.
        transform_fn: optional ``(pyarrow.RecordBatch) -> {name: numpy array}``, run on the
            executors (every epoch, on the raw rows, unless ``cache_transformed``) and in
            ``transform``; it decodes what no built-in decoder reads (image bytes, text). Its
            keys other than the label and weight columns are model inputs, and the model is
            called as ``model(**inputs)``. It may take ``training: bool`` (False in transform).
        scheduler_fn: optional ``(optimizer) -> torch.optim.lr_scheduler.LRScheduler``, stepped
            after every optimizer step (on the server's optimizers for the parameter server),
            instead of the ``lr_schedule`` setting.
        parallelize_fn: optional ``(module, mesh) -> None`` for ``strategy = "tensor"``: your
            own split of the whole model over a tensor-parallel group's 1-D ``DeviceMesh``
            (e.g. ``parallelize_module(module, mesh, {"attn.qkv": ColwiseParallel(), ...})``),
            called on every worker instead of the built-in plan and ``tensor_plan``.
        validation: rows to measure after every epoch (val_loss, and val_accuracy or val_rmse,
            in ``history``): a fraction of the rows (the ``validation_fraction`` setting), a
            boolean column's name (``validation_col``), or a DataFrame with the same columns.
            With ``early_stopping_patience`` training stops when val_loss stops improving and
            the best epoch's weights are kept.
        config: a :class:`SparkDLConfig` or the path of a TOML file; keyword settings
            override it.
        initial_model: a fitted ``TorchModel``, or the path of one saved with ``save``: the fit
            starts from its weights instead of ``model_fn``'s (a warm start: yesterday's model
            trained on today's partitions), fetched by each worker from the driver as
            ``transform`` fetches them. The model's ``initial_model`` names it (saved with the
            model, and an MLflow tag). The optimizer starts afresh.
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
        transform_fn: TransformFn | None = None,
        scheduler_fn: SchedulerFn | None = None,
        parallelize_fn: ParallelizeFn | None = None,
        validation: float | str | Any = None,
        config: SparkDLConfig | str | Path | None = None,
        initial_model: TorchModel | str | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        self._init_defaults()
        self.validation_df: Any = None
        self.initial_model = initial_model
        if isinstance(validation, bool):
            raise ConfigError(
                "validation must be a fraction, a boolean column's name or a DataFrame, not a bool"
            )
        if isinstance(validation, int | float):
            settings = {**settings, "validation_fraction": float(validation)}
        elif isinstance(validation, str):
            settings = {**settings, "validation_col": validation}
        elif validation is not None:
            self.validation_df = validation
        self._apply_settings(config, settings)
        chosen = choose_loss(loss_fn, self.get_config().training.loss)
        if isinstance(chosen, str):  # a named loss is the setting, so Params and persistence show it
            self._apply_settings(None, {"loss": chosen})
        self.model_fn = model_fn
        self.optimizer_fn = optimizer_fn
        self.loss_fn: LossFn | None = None if isinstance(chosen, str) else chosen
        self.transform_fn = transform_fn
        self.scheduler_fn = scheduler_fn
        self.parallelize_fn = parallelize_fn

    def _initial(self) -> tuple[torch.nn.Module, str]:
        """The module ``initial_model`` holds, and what it is (for the lineage).

        Raises:
            ConfigError: it is neither a fitted TorchModel nor the path of a saved one.
        """
        initial = self.initial_model
        if isinstance(initial, str | Path):
            loaded = TorchModel.load(str(initial), model_fn=self.model_fn)
            assert loaded.module is not None
            return loaded.module, str(initial)
        if isinstance(initial, TorchModel) and initial.module is not None:
            return initial.module, f"TorchModel {initial.uid}" + (
                f" (itself from {initial.initial_model})" if initial.initial_model else ""
            )
        raise ConfigError(
            f"initial_model must be a fitted TorchModel or the path of one saved with save(), not "
            f"{type(initial).__name__}"
        )

    def _loss(self) -> str | LossFn:
        return choose_loss(self.loss_fn, self.get_config().training.loss)

    def write(self) -> MLWriter:
        return TorchEstimatorWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return TorchEstimatorReader(cls)

    @classmethod
    def load(cls, path: str, trust_pickle: bool | None = None, **functions: Any) -> TorchEstimator:
        """Load an estimator saved with ``save``: its settings, and its functions from you
        (``model_fn=make_model``, and any other it was saved with: ``optimizer_fn=``, ...).

        The functions saved with it are pickled code and are unpickled, which runs it, only
        with ``trust_pickle=True``: for directories you trust (see :func:`sparkdl.loading`).
        The settings in :data:`sparkdl.ml.persistence.UNTRUSTED_SETTINGS` keep their defaults
        (a warning names each saved value ignored): set them after load if you trust the folder.

        Raises:
            ConfigError: a function it was saved with was not passed, and trust_pickle is not set.
        """
        unknown = sorted(
            name for name in functions if not hasattr(TorchEstimator(), name) or not name.endswith("_fn")
        )
        if unknown:
            raise ConfigError(
                f"TorchEstimator.load got {unknown}, which are not functions of a TorchEstimator"
            )
        return TorchEstimatorReader(cls, trust_pickle, **functions).load(path)

    def _fit(self, dataset: Any) -> TorchModel:
        dataset, spec = self.training_spec(dataset)
        config, loss = spec.config, spec.loss
        assert self.model_fn is not None  # training_spec refuses an estimator without one
        check_tracking(config)  # a store MLflow refuses fails now, not after training
        started = time.perf_counter()
        result = run_training(dataset, spec)
        module = module_with_state(self.model_fn, result.state_dict)
        model = TorchModel(
            module=module,
            model_fn=self.model_fn,
            history=result.history,
            output_shape=result.output_shape,
            classifier=isinstance(loss, str) and loss in ("cross_entropy", "causal_lm"),
            trained_input_shapes=result.input_shapes,
            transform_fn=self.transform_fn,
        )
        model.initial_model = spec.model_fn.source if isinstance(spec.model_fn, WarmStart) else ""
        text = next((s.text for s in spec.plan.inputs if s.text is not None), None)
        if text is not None:  # the file as fit read it: transform and save need it no more
            model.tokenizer_file = (config.data.tokenizer, text.json)
        model.worker_rows = result.worker_rows
        model.worker_devices = result.worker_devices
        model.bad_rows_skipped = result.bad_rows_skipped
        model = self._copyValues(model)
        model.mlflow_run_id = log_fit(config, model, time.perf_counter() - started)
        return model

    def training_spec(self, dataset: Any) -> tuple[Any, TrainSpec]:
        """The DataFrame as the training stage reads it (RDDs converted, Vectors as arrays,
        held-out rows marked) and the workers' task spec: what ``fit`` and
        :func:`sparkdl.advise` run.

        Raises:
            ConfigError: settings that contradict each other or the functions given.
            SchemaError: a column the settings name is missing or of a type it cannot be.
        """
        if self.model_fn is None:
            raise ConfigError("TorchEstimator needs model_fn: a function that builds the torch.nn.Module")
        check_shippable(
            {
                "model_fn": self.model_fn,
                "optimizer_fn": self.optimizer_fn,
                "loss_fn": self.loss_fn,
                "transform_fn": self.transform_fn,
                "scheduler_fn": self.scheduler_fn,
                "parallelize_fn": self.parallelize_fn,
            },
            "TorchEstimator",
        )
        if is_rdd(dataset):  # Rows, dicts or (features, label) tuples, typed where they live
            dataset = rdd_to_dataframe(dataset)
        elif getattr(dataset, "isStreaming", False):
            raise ConfigError(
                "fit got a streaming DataFrame, which has no end to train epochs over; train each "
                "micro-batch instead: df.writeStream.foreachBatch(sparkdl.fit_stream(estimator, model_dir))"
                ".option('checkpointLocation', ...).start() fits each one from the version the one before "
                "published (initial_model) and publishes a version per batch id (docs/guide/streaming.md)"
            )
        config = self.get_config()
        loss = self._loss()
        _, label_kind = resolve_loss(loss)
        if config.data.weight_col and not takes_weight(loss):
            raise ConfigError(
                f"weight_col = {config.data.weight_col!r} but loss_fn takes no weight; give it a third "
                "parameter `weight` (per-row weights) or unset weight_col"
            )
        if self.scheduler_fn is not None and not lr_plan(config).is_constant:
            raise ConfigError(
                "scheduler_fn and the lr_schedule / warmup_steps / scale_lr settings both set the "
                "learning rate; use one: drop scheduler_fn, or leave those settings at their defaults"
            )
        if self.parallelize_fn is not None:
            check_parallelize_fn(config)
        config = with_spark_storage_options(dataset.sparkSession, config)  # the checks above need no data
        if self.transform_fn is None:  # transform_fn reads the columns as the DataFrame has them
            dataset = vectors_as_arrays(dataset)
        dataset, validation_col = with_validation(dataset, config, self.validation_df)
        check_full_batch_inputs(config, self.optimizer_fn, self.scheduler_fn, bool(validation_col))
        plan = plan_inputs(
            dataset,
            config.data,
            label_kind,
            self.transform_fn,
            validation_col=validation_col,
            next_token_of=token_input(config.data) if loss == "causal_lm" else "",
        )
        model_fn: ModelFn = self.model_fn
        if self.initial_model is not None:
            initial, source = self._initial()
            model_fn = warm_start(
                dataset.sparkSession, self.model_fn, initial, source, config.runtime.encrypt
            )
        spec = TrainSpec(
            config,
            model_fn,
            self.optimizer_fn,
            loss,
            plan,
            scheduler_fn=self.scheduler_fn,
            parallelize_fn=self.parallelize_fn,
        )
        return dataset, spec


TorchEstimator.__doc__ = with_settings_section(TorchEstimator.__doc__)


class TorchModel(Model, _SparkDLParams, MLWritable, MLReadable):
    """A trained model: ``transform`` adds predictions, computed on the executors.

    Like pyspark.ml's classifiers, a classifier (trained with cross_entropy, or with
    bce_with_logits and one output) adds ``prediction`` (the class index), ``rawPrediction``
    and ``probability`` (ml Vectors), so the stock evaluators read them on their defaults;
    a regression adds ``prediction`` only; a causal language model (``loss_fn = "causal_lm"``)
    each position's predicted next token and ``perplexity``, per row. The names are the
    settings ``prediction_col``, ``raw_prediction_col``, ``probability_col`` and
    ``perplexity_col`` ("" leaves a column out).

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
        trained_input_shapes: dict[str, tuple[int, ...]] | None = None,
        transform_fn: TransformFn | None = None,
    ) -> None:
        super().__init__()
        self._init_defaults()
        self.module = module
        self.model_fn = model_fn
        self.transform_fn = transform_fn  # the estimator's, run on every batch transform reads
        self.history = list(history or [])
        self.output_shape = tuple(output_shape)
        # one row of each input as the model saw it (the setting input_shapes is a Param)
        self.trained_input_shapes = {
            name: tuple(shape) for name, shape in (trained_input_shapes or {}).items()
        }
        self.classifier = classifier
        self.worker_rows: list[int] = []
        self.worker_devices: list[dict[str, Any]] = []  # per rank: device and Spark-assigned GPUs
        self.bad_rows_skipped = 0  # rows dropped by on_bad_rows = "skip"
        self.mlflow_run_id: str | None = None  # the MLflow run fit logged to, if any
        self.initial_model = ""  # what its fit started from (initial_model), "" for model_fn's weights
        # data.tokenizer's file as fit or load read it, with that path: transform and save use
        # these bytes while the setting names that path (the file may be gone since)
        self.tokenizer_file: tuple[str, bytes] | None = None

    def kept_tokenizer(self) -> bytes | None:
        """The tokenizer file read at fit or load, while ``data.tokenizer`` still names it."""
        kept = self.tokenizer_file
        return kept[1] if kept is not None and kept[0] == self.getOrDefault("tokenizer") else None

    @property
    def keyword_inputs(self) -> bool:
        """Whether the model takes named inputs (``inputs`` or ``transform_fn``), not ``model(x)``."""
        return bool(self.getOrDefault("inputs")) or self.transform_fn is not None

    def _transform(self, dataset: Any) -> Any:
        if self.module is None or self.model_fn is None:
            raise ConfigError("this TorchModel holds no trained module; fit or load one first")
        config = self.get_config()
        mode = output_mode(
            self.classifier, self.output_shape, binary=config.training.loss == "bce_with_logits"
        )
        causal = config.training.loss == "causal_lm"
        columns = OutputCols(
            config.data.prediction_col,
            config.data.raw_prediction_col,
            config.data.probability_col,
            config.data.perplexity_col if causal else "",
        )
        schema = prediction_schema(dataset.schema, columns, mode)
        spec = PredictSpec(
            model_fn=self.model_fn,
            weights=model_weights(dataset.sparkSession, self.module, config.runtime.encrypt),
            plan=plan_inputs(
                dataset,
                config.data,
                LabelKind.REAL,
                self.transform_fn,
                with_label=False,
                tokenizer_json=self.kept_tokenizer(),
            ),
            columns=columns,
            mode=mode,
            batch_size=config.data.inference_batch_size,
            use_gpu=config.runtime.use_gpu,
            torch_threads=config.runtime.torch_threads,
            compile_backend=config.training.compile_backend if config.training.compile else "",
            perplexity_of=token_input(config.data) if causal else "",
        )
        return dataset.mapInArrow(functools.partial(predict_partition, spec), schema)

    def plot_history(self, path: str | Path) -> Path:
        """Write a PNG of the loss and samples/s per epoch (job and each worker) to ``path``."""
        from sparkdl.ml.plots import plot_history

        return plot_history(self.history, path, title=f"sparkdl fit: {self.getOrDefault('strategy')}")

    def write(self) -> MLWriter:
        return TorchModelWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        return TorchModelReader(cls)

    @classmethod
    def load(
        cls,
        path: str,
        model_fn: ModelFn | None = None,
        transform_fn: TransformFn | None = None,
        trust_pickle: bool | None = None,
    ) -> TorchModel:
        """Load a model saved with ``save``: its weights (tensors only, memory-mapped), its
        architecture from ``model_fn`` (and ``transform_fn`` if it was trained with one).

        The factory saved with it is pickled code and is unpickled, which runs it, only with
        ``trust_pickle=True``: for directories you trust (see :func:`sparkdl.loading`).
        The settings in :data:`sparkdl.ml.persistence.UNTRUSTED_SETTINGS` keep their defaults
        (a warning names each saved value ignored): set them after load if you trust the folder.

        Raises:
            ConfigError: no model_fn was given and trust_pickle is not set, or a local
                ``weights.pt`` is a symlink out of the folder.
        """
        return TorchModelReader(cls, model_fn, transform_fn, trust_pickle).load(path)
