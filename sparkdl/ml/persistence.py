"""Spark ML persistence of :class:`~sparkdl.ml.estimator.TorchModel` and
:class:`~sparkdl.ml.estimator.TorchEstimator`: settings as Spark ML metadata, weights as a
``weights_only`` torch file, user functions cloudpickled beside them.

The readers and writers know the stages only through the attributes they save
(:class:`SavedModel`) and the class the caller hands a reader, so this module sits below
the estimator and imports nothing of it.

Loading runs no code from the saved directory. The weights are read with
``torch.load(weights_only=True)``, which only rebuilds tensors. The architecture is code,
so it comes from the caller: ``TorchModel.load(path, model_fn=make_model)`` (and
``transform_fn=`` for a model trained with one). The pickled factory in the directory
is unpickled, which runs whatever it holds, only on ``trust_pickle=True``. Inside a
``PipelineModel.load`` or ``CrossValidatorModel.load``, which call the reader without
arguments, the same choices apply through :func:`loading`::

    with sparkdl.loading(model_fn=make_model):
        pipeline = PipelineModel.load(path)

A saved folder may come from someone else, so it does not choose the settings in
:data:`UNTRUSTED_SETTINGS` (what is trusted, written where, sent in the clear): load keeps
their defaults and warns about each saved value it ignored. And a file load reads from
a local folder (the weights, the pickled functions) must lie in that folder: a symlink
out of it is refused, so a folder cannot make load read any file of this machine.

The weights file is written by ``torch.save`` straight to a file and loaded memory-mapped
into a module built on the meta device, so saving or loading a model of N bytes holds
about N bytes, not two or three copies.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar, cast

import cloudpickle
import torch
from pyspark.ml.param import Params
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from sparkdl.config import SECRET_SETTINGS, SparkDLConfig, flat_field_owners
from sparkdl.errors import ConfigError, listed
from sparkdl.spark.driver import read_tokenizer
from sparkdl.storage import fs
from sparkdl.training.factory import build_model, cpu_state_dict, module_with_state

_LOADING = threading.local()
_log = logging.getLogger(__name__)

#: Settings load never takes from a saved folder's metadata: each decides what is trusted,
#: where something is written, or what crosses the network in the clear or to where, so a
#: folder from someone else must not choose them. The loaded stage keeps its defaults.
UNTRUSTED_SETTINGS: tuple[str, ...] = (
    "encrypt",  # whether the driver's sockets carry weights and gradients in the clear
    "network_interface",  # which network the workers' plain-TCP traffic (gloo, NCCL) crosses
    "cache_dir",  # where the workers write the decoded training rows
    "storage_options",  # credentials of the object store: never saved (see _save_metadata), never loaded
    "checkpoint_dir",  # where checkpoints (the weights) are written, and what a fit resumes from
    "checkpoint_every",  # needs checkpoint_dir: kept with it, or the settings would not validate
    "fault_injection",  # writes a marker file at any path, kills workers or executor JVMs
    "mlflow_experiment",  # where the run and the trained model are logged
    "mlflow_pickle_model",  # logs a pickled model, which runs code when loaded
    "tokenizer",  # a file the driver reads: a saved model brings its own copy (tokenizer.json)
)

#: The copy of ``data.tokenizer``'s file a saved model keeps beside its weights, so that it
#: transforms text wherever it is loaded, the original file gone or out of reach.
TOKENIZER_FILE = "tokenizer.json"


class SavedModel(Protocol):
    """What a fitted model keeps beside its Params: the attributes the writer saves."""

    uid: str
    module: torch.nn.Module | None
    model_fn: Callable[[], torch.nn.Module] | None
    history: list[dict[str, Any]]
    output_shape: tuple[int, ...]
    trained_input_shapes: dict[str, tuple[int, ...]]
    classifier: bool
    transform_fn: Callable[..., Any] | None
    initial_model: str

    def get_config(self) -> SparkDLConfig: ...

    def kept_tokenizer(self) -> bytes | None: ...


#: The class a reader builds: ``TorchModel`` or ``TorchEstimator``.
R = TypeVar("R", bound=Params)


@contextlib.contextmanager
def loading(trust_pickle: bool = False, **functions: Callable[..., Any]) -> Iterator[None]:
    """Within the block, every sparkdl model or estimator loaded without arguments (as
    ``PipelineModel.load`` and ``CrossValidatorModel.load`` load their stages) takes its
    functions from ``functions`` (``model_fn=``, ``transform_fn=``, ``optimizer_fn=``, ...)
    or, with ``trust_pickle=True``, unpickles the ones saved with it (which runs their code:
    only for directories you trust)."""
    previous = getattr(_LOADING, "options", None)
    _LOADING.options = (trust_pickle, functions)
    try:
        yield
    finally:
        _LOADING.options = previous


def _options(trust_pickle: bool | None, functions: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """The caller's options, or else those of the enclosing :func:`loading` block."""
    outer_trust, outer_functions = getattr(_LOADING, "options", None) or (False, {})
    given = {name: f for name, f in functions.items() if f is not None}
    return bool(trust_pickle if trust_pickle is not None else outer_trust), {**outer_functions, **given}


def _refused(path: str, what: str, names: list[str], files: str, cls: str) -> ConfigError:
    example = ", ".join(f"{name}=..." for name in names)
    return ConfigError(
        f"{path} holds {what} only as pickled code ({files}); unpickling runs whatever code it "
        f"holds, so load refuses it. Pass the code yourself: {cls}.load(path, {example}); or, if "
        f"you trust whoever wrote {path}: {cls}.load(path, trust_pickle=True). Inside "
        f"PipelineModel.load or CrossValidatorModel.load: with sparkdl.loading({example}): ... "
        "(or sparkdl.loading(trust_pickle=True))"
    )


def _without_untrusted(stage: Params, metadata: dict[str, Any], path: str) -> dict[str, Any]:
    """``metadata`` less the :data:`UNTRUSTED_SETTINGS`, so ``stage`` keeps its defaults for
    them; a warning names each saved value that differs from the default it keeps."""
    saved = {**metadata.get("defaultParamMap", {}), **metadata.get("paramMap", {})}
    ignored = {
        name: saved[name]
        for name in UNTRUSTED_SETTINGS
        if name in saved and saved[name] != stage.getOrDefault(name)
    }
    if ignored:
        owners, kind = flat_field_owners(), type(stage).__name__
        var = "model" if kind.endswith("Model") else "estimator"
        values = ", ".join(f"{owners[name]}.{name} = {value!r}" for name, value in ignored.items())
        kept = ", ".join(f"{name} = {stage.getOrDefault(name)!r}" for name in ignored)
        sets = "; ".join(f"{var}.set({var}.{name}, {value!r})" for name, value in ignored.items())
        _log.warning(
            "%s.load(%r) ignored settings saved with it that decide what is trusted, written where "
            "or sent in the clear, which a folder from someone else must not choose: %s. It keeps "
            "the defaults (%s). If you trust whoever wrote %s, set them after load: %s",
            kind,
            path,
            values,
            kept,
            path,
            sets,
        )
    cleaned = dict(metadata)
    for key in ("paramMap", "defaultParamMap"):
        if key in metadata:
            cleaned[key] = {k: v for k, v in metadata[key].items() if k not in UNTRUSTED_SETTINGS}
    return cleaned


def _inside(folder: str, name: str) -> str:
    """``folder/name``, checked to lie in ``folder`` when it is local (another scheme's files
    are the JVM's to read, and a symlink there is its file system's business).

    Raises:
        ConfigError: the file is a symlink that resolves outside the folder.
    """
    path = f"{folder}/{name}"
    local = fs.local_path(folder)
    if local is None or not (local / name).is_symlink():
        return path
    target, home = (local / name).resolve(), local.resolve()
    if not target.is_relative_to(home):
        raise ConfigError(
            f"{path} is a symlink to {target}, outside the saved folder {home}; load reads only "
            "files inside the folder it was given (a folder from someone else could point a link "
            f"at any file of this machine). If you meant that file, copy it into the folder in "
            f"place of the link: cp --remove-destination {target} {local / name}"
        )
    return path


def _save_metadata(stage: Params, path: str, spark: Any, extra: dict[str, Any], overwrite: bool) -> None:
    """Spark ML's metadata of ``stage`` less the :data:`SECRET_SETTINGS` (credentials), written
    through fsspec on an object store it reaches (the JVM needs no connector for it), else by
    Spark."""
    chosen = {p.name: v for p, v in stage._paramMap.items() if p.name not in SECRET_SETTINGS}
    text = DefaultParamsWriter._get_metadata_to_save(stage, spark, extra, chosen)
    metadata = json.loads(text)
    metadata["defaultParamMap"] = {
        k: v for k, v in metadata.get("defaultParamMap", {}).items() if k not in SECRET_SETTINGS
    }
    text = json.dumps(metadata, separators=(",", ":"))
    if not fs.write_metadata(spark, path, text, overwrite):
        spark.createDataFrame([(text,)], schema=["value"]).coalesce(1).write.text(f"{path}/metadata")


def _load_metadata(path: str, spark: Any) -> dict[str, Any]:
    """The metadata :func:`_save_metadata` wrote (through fsspec where it reaches ``path``)."""
    text = fs.read_metadata(spark, path)
    if text is None:
        return DefaultParamsReader.loadMetadata(path, spark)
    return cast(dict[str, Any], DefaultParamsReader._parseMetaData(text))


class _StageWriter(MLWriter):
    """Saves through fsspec where it reaches the path: ``overwrite`` removes the old folder
    there, not through the JVM's Hadoop FileSystem (which may lack a connector for it).

    A stage set with ``data.tokenizer`` keeps its own copy of the file (``tokenizer.json``):
    it tokenizes wherever it is loaded, the original file gone or out of reach."""

    def __init__(self, instance: Any) -> None:
        super().__init__()
        self.instance = instance
        self._tokenizer: bytes | None = None

    def save(self, path: str) -> None:
        # the tokenizer is read before an overwrite removes anything: a stage loaded from
        # ``path`` reads its copy there, and saving it over itself must not lose it
        # (checked as a fit checks it), unless the stage kept the bytes it read
        self._tokenizer = self._kept_tokenizer()
        if self._tokenizer is None:  # the settings as set (an estimator's need not validate yet)
            kept = read_tokenizer(self.sparkSession, self.instance._settings().data)
            self._tokenizer = None if kept is None else kept.json
        if self.shouldOverwrite and fs.remove_tree(self.sparkSession, path):
            self.saveImpl(path)
            return
        super().save(path)

    def _kept_tokenizer(self) -> bytes | None:
        """The tokenizer file the stage holds, read at fit or load (None: read it now)."""
        return None

    def _save_tokenizer(self, path: str) -> None:
        if self._tokenizer is not None:  # read by save, before anything was removed
            fs.write_bytes(self.sparkSession, f"{path}/{TOKENIZER_FILE}", self._tokenizer)


def _own_tokenizer(stage: Params, metadata: dict[str, Any], path: str) -> None:
    """A stage saved with a tokenizer reads its own copy, not the path it was set with."""
    if metadata.get("tokenizer"):
        stage.set(stage.getParam("tokenizer"), _inside(path, TOKENIZER_FILE))


class TorchModelWriter(_StageWriter):
    """Saves params as Spark ML metadata, weights as a ``weights_only`` torch file."""

    def _kept_tokenizer(self) -> bytes | None:
        return cast(SavedModel, self.instance).kept_tokenizer()

    def saveImpl(self, path: str) -> None:
        model: SavedModel = self.instance
        assert model.module is not None
        form = self.optionMap.get("weights", "whole")
        state = saved_weights(model.module, form)
        extra = {
            "history": model.history,
            "output_shape": list(model.output_shape),
            "trained_input_shapes": {name: list(shape) for name, shape in model.trained_input_shapes.items()},
            "classifier": model.classifier,
            "transform_fn": model.transform_fn is not None,
            "initial_model": model.initial_model,
            "weights": form,
            "tokenizer": self._tokenizer is not None,
        }
        _save_metadata(cast(Params, model), path, self.sparkSession, extra, self.shouldOverwrite)
        fs.write_file(self.sparkSession, f"{path}/weights.pt", lambda file: torch.save(state, file))
        fs.write_bytes(self.sparkSession, f"{path}/model_fn.cloudpickle", cloudpickle.dumps(model.model_fn))
        if model.transform_fn is not None:
            data = cloudpickle.dumps(model.transform_fn)
            fs.write_bytes(self.sparkSession, f"{path}/transform_fn.cloudpickle", data)
        self._save_tokenizer(path)


#: What ``model.write().option("weights", ...)`` saves: the whole model; only its trained
#: parameters (a LoRA model's adapter: what requires grad), for a model_fn that builds the
#: rest; or a PEFT model merged into its base model (``merge_and_unload``), for a model_fn
#: that builds the base model.
WEIGHT_FORMS = ("whole", "adapter", "merged")


def saved_weights(module: torch.nn.Module, form: str) -> dict[str, torch.Tensor]:
    """The tensors ``form`` saves of ``module``, on CPU.

    Raises:
        ConfigError: an unknown form, an adapter of a model that trains nothing, or a merge
            of a model that is not a PEFT model.
    """
    if form == "whole":
        return cpu_state_dict(module)
    if form == "adapter":
        trained = {name for name, p in module.named_parameters() if p.requires_grad}
        if not trained:
            raise ConfigError(
                "weights = 'adapter' saves the parameters that require grad; this model has none"
            )
        return {name: t for name, t in cpu_state_dict(module).items() if name in trained}
    if form == "merged":
        if not callable(getattr(module, "merge_and_unload", None)):
            raise ConfigError(
                f"weights = 'merged' merges a PEFT model's adapters into its base model; a "
                f"{type(module).__name__} has none: save it whole"
            )
        merged: torch.nn.Module = copy.deepcopy(module).merge_and_unload()  # type: ignore[operator]
        return cpu_state_dict(merged)  # the model keeps its adapters: a copy is merged
    raise ConfigError(f"weights = {form!r}: choose one of {', '.join(WEIGHT_FORMS)}")


def _legacy_shapes(metadata: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """A model saved before named inputs recorded one ``input_shape``: feature_cols' matrix."""
    shape = metadata.get("input_shape")
    return {"features": tuple(shape)} if shape else {}


class TorchModelReader(MLReader[Any], Generic[R]):
    """Loads a model of class ``model_class``: the weights as tensors only, the architecture
    from the caller (or, on ``trust_pickle``, from the pickled factory saved with it)."""

    def __init__(
        self,
        model_class: Callable[..., R],
        model_fn: Callable[[], torch.nn.Module] | None = None,
        transform_fn: Callable[..., Any] | None = None,
        trust_pickle: bool | None = None,
    ) -> None:
        super().__init__()
        self._model_class = model_class
        self._trust, self._functions = trust_pickle, {"model_fn": model_fn, "transform_fn": transform_fn}

    def load(self, path: str) -> R:
        trust, functions = _options(self._trust, self._functions)
        metadata = _load_metadata(path, self.sparkSession)
        wanted = ["model_fn"] + (["transform_fn"] if metadata.get("transform_fn") else [])
        missing = [name for name in wanted if name not in functions]
        if missing and not trust:
            files = ", ".join(f"{name}.cloudpickle" for name in missing)
            raise _refused(path, "its model's architecture", missing, files, "TorchModel")
        for name in missing:  # trusted: the saved code
            functions[name] = cloudpickle.loads(
                fs.read_bytes(self.sparkSession, _inside(path, f"{name}.cloudpickle"))
            )
        with fs.local_file(self.sparkSession, _inside(path, "weights.pt")) as file:
            # memory-mapped: the weights are read from the file as they are used, not copied
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        model_fn = functions["model_fn"]
        module = _module(model_fn, state, str(metadata.get("weights") or "whole"), path)
        model = self._model_class(
            module=module,
            model_fn=model_fn,
            history=metadata["history"],
            output_shape=tuple(metadata["output_shape"]),
            classifier=metadata["classifier"],
            trained_input_shapes=metadata.get("trained_input_shapes") or _legacy_shapes(metadata),
            transform_fn=functions.get("transform_fn") if metadata.get("transform_fn") else None,
        )
        model.initial_model = str(metadata.get("initial_model") or "")  # type: ignore[attr-defined]  # R: a TorchModel
        model._resetUid(metadata["uid"])
        metadata = _without_untrusted(model, metadata, path)
        DefaultParamsReader.getAndSetParams(model, metadata)  # type: ignore[type-var]  # R is MLReadable too
        _own_tokenizer(model, metadata, path)
        if metadata.get("tokenizer"):  # read now, checked as a fit checks it: transform needs it no more
            kept = read_tokenizer(self.sparkSession, model._settings().data)  # type: ignore[attr-defined]  # R: a TorchModel
            assert kept is not None
            model.tokenizer_file = (kept.source, kept.json)  # type: ignore[attr-defined]
        return model


def _module(
    model_fn: Callable[[], torch.nn.Module], state: dict[str, torch.Tensor], form: str, path: str
) -> Any:
    """The loaded module: ``state`` whole (a whole or merged save: model_fn builds that
    model), or an adapter's tensors loaded into what model_fn builds, which holds the rest.

    Raises:
        ConfigError: an adapter whose tensors model_fn's model does not have, or lacks some of
            the parameters it trains.
    """
    if form != "adapter":
        return module_with_state(model_fn, state)
    module = build_model(model_fn)
    result = module.load_state_dict(state, strict=False)
    trained = {name for name, p in module.named_parameters() if p.requires_grad}
    absent = sorted(trained - set(state))
    if result.unexpected_keys or absent:
        raise ConfigError(
            f"{path} holds an adapter (weights = 'adapter') that does not fit model_fn's model: "
            f"{len(result.unexpected_keys)} of its tensors are not the model's "
            f"({listed(result.unexpected_keys)}), {len(absent)} of the model's trained "
            f"parameters are not in it ({listed(absent)}); load it with the model_fn it was "
            "trained with (the base model and its adapter, e.g. peft.get_peft_model)"
        )
    return module


class TorchEstimatorWriter(_StageWriter):
    """Saves an unfitted estimator (e.g. inside a saved Pipeline or CrossValidatorModel):
    its settings as Spark ML metadata and its functions cloudpickled."""

    def saveImpl(self, path: str) -> None:
        # every user function (model_fn, optimizer_fn, loss_fn, ...): what is not a Param
        functions = {name: value for name, value in vars(self.instance).items() if name.endswith("_fn")}
        saved = sorted(name for name, value in functions.items() if value is not None)
        extra = {"functions": saved, "tokenizer": self._tokenizer is not None}
        _save_metadata(self.instance, path, self.sparkSession, extra, self.shouldOverwrite)
        fs.write_bytes(self.sparkSession, f"{path}/functions.cloudpickle", cloudpickle.dumps(functions))
        self._save_tokenizer(path)


class TorchEstimatorReader(MLReader[Any], Generic[R]):
    """Loads a TorchEstimator: its settings, and its functions from the caller (or, on
    ``trust_pickle``, unpickled from the directory)."""

    def __init__(
        self,
        estimator_class: Callable[[], R],
        trust_pickle: bool | None = None,
        **functions: Callable[..., Any] | None,
    ) -> None:
        super().__init__()
        self._estimator_class = estimator_class
        self._trust, self._functions = trust_pickle, functions

    def load(self, path: str) -> R:
        trust, functions = _options(self._trust, self._functions)
        metadata = _load_metadata(path, self.sparkSession)
        if trust:  # the saved code, under what the caller passed
            data = fs.read_bytes(self.sparkSession, _inside(path, "functions.cloudpickle"))
            saved = cloudpickle.loads(data)
            functions = {**saved, **functions}
        else:
            # the names of the functions saved; a directory of an older sparkdl does not say
            needed = metadata.get("functions", ["model_fn"])
            missing = sorted(set(needed) - set(functions))
            if missing:
                raise _refused(path, "its functions", missing, "functions.cloudpickle", "TorchEstimator")
        estimator = self._estimator_class()
        for name, value in functions.items():
            setattr(estimator, name, value)
        estimator._resetUid(metadata["uid"])
        metadata = _without_untrusted(estimator, metadata, path)
        DefaultParamsReader.getAndSetParams(estimator, metadata)  # type: ignore[type-var]  # R is MLReadable too
        _own_tokenizer(estimator, metadata, path)
        return estimator
