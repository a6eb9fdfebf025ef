"""MLflow logging of a fit (``TorchEstimator``) or a run (``sparkdl.run``), on the driver,
when MLflow is installed and pointed somewhere.

Logged: every setting as a param, each epoch's figures as metrics (step = epoch), and
the trained model through ``mlflow.pytorch`` in the ``pt2`` graph format when the model
exports with an example batch (loading it runs no Python code of ours). A model that
does not export is logged pickled only when ``mlflow_pickle_model`` asks for it (loading
a pickle runs its code); otherwise only its weights are logged, as a ``weights_only``
torch file that ``TorchModel.load``'s own format reads back into ``model_fn()``. Inside
an active run (a notebook's, or a pipeline's) the fit becomes a nested run; so does a fit
in a thread of its own while another thread holds a run, as pyspark.ml's tuning fits its
trials in pool threads while the caller's thread holds the tuning run (MLflow keeps the
active run per thread).

Nothing is logged unless a tracking URI was chosen (``MLFLOW_TRACKING_URI``,
``mlflow.set_tracking_uri``, Databricks' own) or a run is active: sparkdl never
creates an ``mlruns`` directory a user did not ask for.

Logging never costs the trained model: :func:`check_tracking` opens the store before
training (a store MLflow refuses fails the fit at once, naming the URI and the fix), and
:func:`log_fit` turns a failure while logging into a warning. A ``sparkdl.run`` logs its
settings and rank 0's ``ctx.report`` records (:func:`log_run`); what ``train_fn`` returns
is the user's to log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any, Protocol
from urllib.parse import urlparse

import torch

from sparkdl.config import SparkDLConfig
from sparkdl.errors import ConfigError
from sparkdl.training.factory import cpu_state_dict

log = logging.getLogger(__name__)


class TrackedModel(Protocol):
    """What MLflow logging reads of a fitted model (a ``TorchModel``)."""

    module: torch.nn.Module | None
    history: list[dict[str, Any]]
    trained_input_shapes: dict[str, tuple[int, ...]]
    initial_model: str  # what its fit started from ("" for model_fn's weights)

    @property
    def keyword_inputs(self) -> bool: ...


_EPOCH_METRICS = (
    "loss",
    "samples",
    "samples_per_s",
    "seconds",
    "steps",
    "sync_rounds",
    "bytes_sent",
    "bytes_received",
    "staleness_mean",
    "staleness_max",
    "wait_s",
    "nan_skips",
    "val_loss",
    "val_accuracy",
    "val_rmse",
    "val_samples",
)


def mlflow_if_configured(config: SparkDLConfig) -> Any | None:
    """The ``mlflow`` module when fit should log to it, else None."""
    if not config.tracking.mlflow:
        return None
    if "mlflow" not in sys.modules and not os.environ.get("MLFLOW_TRACKING_URI"):
        # No URI in the environment, and nothing imported MLflow to set one or start a run:
        # nothing to log to. (Importing it only to find that out costs ~1.3 s on a first fit.)
        return None
    try:
        import mlflow
    except ImportError:
        return None
    if os.environ.get("MLFLOW_TRACKING_URI") or mlflow.active_run() is not None or _uri_was_set():
        return mlflow
    return mlflow if _other_threads_run(mlflow) is not None else None


#: The runs this process's fits started and have not ended: never a parent of another fit's
#: (trials side by side each hold their own while they log).
_OURS: set[str] = set()
_OURS_LOCK = threading.Lock()


def _other_threads_run(mlflow: Any) -> Any | None:
    """The run another live thread of this process holds, when exactly one run is held
    elsewhere and none here, and it is not a fit's own: the tuning run whose trials this
    thread fits (pyspark.ml's tuning fits them in pool threads, and MLflow's active run is
    per thread). None where this MLflow keeps no per-thread table of runs."""
    stacks = getattr(getattr(mlflow.tracking, "fluent", None), "_active_run_stack", None)
    every_thread = getattr(stacks, "get_all_thread_values", None)
    if every_thread is None or mlflow.active_run() is not None:
        return None
    here, alive = threading.get_ident(), {thread.ident for thread in threading.enumerate()}
    with _OURS_LOCK:
        ours = set(_OURS)
    held = {
        run.info.run_id: run
        for ident, runs in every_thread().items()
        if ident != here and ident in alive
        for run in runs
        if run.info.run_id not in ours
    }
    return next(iter(held.values())) if len(held) == 1 else None


def _uri_was_set() -> bool:
    try:
        from mlflow.tracking._tracking_service.utils import is_tracking_uri_set
    except ImportError:  # a future MLflow moved it: fall back to the environment only
        return False
    return bool(is_tracking_uri_set())


#: Stores whose check would wait on the network (MLflow retries a request for minutes):
#: only opened before training, and a failure to log there warns after it.
_REMOTE_SCHEMES = frozenset({"http", "https", "databricks", "databricks-uc", "uc"})


def check_tracking(config: SparkDLConfig) -> None:
    """Open the tracking store fit will log to, before any worker starts.

    Raises:
        ConfigError: MLflow refuses the store; the message names the URI and the fix.
    """
    mlflow = mlflow_if_configured(config)
    if mlflow is None:
        return
    uri = mlflow.get_tracking_uri()
    try:
        client = mlflow.MlflowClient()
        if urlparse(uri).scheme not in _REMOTE_SCHEMES:
            client.search_experiments(max_results=1)
    except Exception as exc:
        raise ConfigError(
            f"MLflow cannot log this fit to tracking URI {uri!r}: {_reason(exc)} {_fix(uri, str(exc))}; "
            "or set mlflow = false to train without logging"
        ) from exc


def _reason(exc: Exception, limit: int = 1_000) -> str:
    """MLflow's first line, whole (its links and settings are the useful part), or cut at a
    space near ``limit`` characters, never inside a word or a link."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if len(first) > limit:
        first = first[: first.rfind(" ", 0, limit)] + " ..."
    return first if first.endswith((".", "...")) else first + "."


def _fix(uri: str, message: str) -> str:
    """What makes ``uri`` work, for the store errors users meet."""
    scheme = urlparse(uri).scheme
    if "MLFLOW_ALLOW_FILE_STORE" in message or scheme in ("", "file"):
        return (
            "MLflow 3 keeps file stores in maintenance mode: set the environment variable "
            "MLFLOW_ALLOW_FILE_STORE=true before the driver starts, or log to a tracking server "
            "(http://...)"
        )
    if scheme in ("sqlite", "postgresql", "mysql", "mssql"):
        return (
            f"a {scheme}: store needs the full MLflow package (pip install mlflow; the sparkdl-torch "
            "[mlflow] extra installs mlflow-skinny, which talks to tracking servers and file stores)"
        )
    return "check that the URI is reachable from the driver"


def log_fit(config: SparkDLConfig, model: TrackedModel, fit_seconds: float) -> str | None:
    """Log ``model``'s fit to MLflow if configured; return the run id (None: not logged).

    A failure while logging is a warning: the model is trained, and the caller keeps it.
    """
    mlflow = mlflow_if_configured(config)
    if mlflow is None:
        return None
    try:
        return _log(mlflow, config, model, fit_seconds)
    except Exception as exc:  # the store, the network, an export: never worth the model
        log.warning(
            "MLflow: the fit was trained but logging it to %s failed (%s: %s); the model is returned "
            "unlogged: save it with model.save(path), or log it yourself with mlflow.pytorch.log_model",
            mlflow.get_tracking_uri(),
            type(exc).__name__,
            str(exc)[:500],
        )
        return None


def log_run(config: SparkDLConfig, history: list[dict[str, Any]], run_seconds: float) -> str | None:
    """Log a ``sparkdl.run`` to MLflow if configured: every setting as a param, each of
    ``history``'s records (rank 0's ``ctx.report``) as metrics at its global step, and the
    run's seconds; return the run id (None: not logged). A failure is a warning."""
    mlflow = mlflow_if_configured(config)
    if mlflow is None:
        return None
    try:
        with _started_run(mlflow, config) as run:
            mlflow.log_params({name: _param(value) for name, value in config.flat_shown().items()})
            for i, record in enumerate(history):
                step = int(record.get("step", i))
                metrics = {
                    k: float(v)
                    for k, v in record.items()
                    if k not in ("epoch", "step") and isinstance(v, int | float) and not isinstance(v, bool)
                }
                if metrics:
                    mlflow.log_metrics(metrics, step=step)
            mlflow.log_metric("run_seconds", run_seconds)
            return str(run.info.run_id)
    except Exception as exc:  # the store or the network: never worth the run's result
        log.warning(
            "MLflow: the run finished but logging it to %s failed (%s: %s); its result is returned unlogged",
            mlflow.get_tracking_uri(),
            type(exc).__name__,
            str(exc)[:500],
        )
        return None


@contextlib.contextmanager
def _started_run(mlflow: Any, config: SparkDLConfig) -> Iterator[Any]:
    """:func:`_new_run`, known as a fit's own while it lasts (:func:`_other_threads_run`)."""
    with _new_run(mlflow, config) as run:
        with _OURS_LOCK:
            _OURS.add(run.info.run_id)
        try:
            yield run
        finally:
            with _OURS_LOCK:
                _OURS.discard(run.info.run_id)


def _new_run(mlflow: Any, config: SparkDLConfig) -> Any:
    """A new MLflow run for this fit or run: nested inside an active one (a notebook's, a
    pipeline's), else in ``mlflow_experiment``, without changing the caller's process-wide
    MLflow state (``mlflow.set_experiment`` would)."""
    tracking = config.tracking
    nested = mlflow.active_run() is not None
    parent = None if nested else _other_threads_run(mlflow)
    if parent is not None:  # a trial of a tuning run held by the thread that started it
        return mlflow.start_run(
            run_name=tracking.mlflow_run_name or None,
            nested=True,
            parent_run_id=parent.info.run_id,
            experiment_id=parent.info.experiment_id,
        )
    experiment_id = (
        _experiment_id(mlflow, tracking.mlflow_experiment)
        if tracking.mlflow_experiment and not nested
        else None
    )
    return mlflow.start_run(
        run_name=tracking.mlflow_run_name or None, nested=nested, experiment_id=experiment_id
    )


def _log(mlflow: Any, config: SparkDLConfig, model: TrackedModel, fit_seconds: float) -> str:
    tracking = config.tracking
    with _started_run(mlflow, config) as run:
        params = {name: _param(value) for name, value in config.flat_shown().items()}
        mlflow.log_params(params)
        for record in model.history:
            metrics = {k: float(record[k]) for k in _EPOCH_METRICS if isinstance(record.get(k), int | float)}
            mlflow.log_metrics(metrics, step=int(record["epoch"]))
        mlflow.log_metric("fit_seconds", fit_seconds)
        if model.initial_model:  # the lineage: what the fit started from
            mlflow.set_tag("sparkdl.initial_model", model.initial_model)
        if tracking.mlflow_log_model and model.module is not None:
            _log_model(mlflow, model, config.tracking.mlflow_pickle_model)
        log.info("logged the fit to MLflow run %s (%s)", run.info.run_id, mlflow.get_tracking_uri())
        return str(run.info.run_id)


def _experiment_id(mlflow: Any, name: str) -> str:
    experiment = mlflow.get_experiment_by_name(name)
    return str(experiment.experiment_id) if experiment is not None else str(mlflow.create_experiment(name))


def _log_model(mlflow: Any, model: TrackedModel, pickle: bool = False) -> None:
    import mlflow.pytorch

    assert model.module is not None
    module = model.module.eval()
    requirements = [f"torch=={torch.__version__.split('+')[0]}"]
    shapes = model.trained_input_shapes
    reason = "it takes named inputs, which the pt2 export is not given an example of"
    if len(shapes) == 1 and not model.keyword_inputs:  # model(x): an example export can trace
        example = torch.zeros((2, *next(iter(shapes.values()))))  # a batch of 1 would fix the batch size
        try:
            mlflow.pytorch.log_model(
                module, name="model", input_example=example.numpy(), pip_requirements=requirements
            )
            return
        except Exception as exc:  # torch.export cannot trace every model
            reason = f"it does not export as pt2 ({exc})"
    if pickle:
        log.warning("MLflow: logging the model pickled (mlflow_pickle_model = true) because %s", reason)
        mlflow.pytorch.log_model(
            module, name="model", serialization_format="pickle", pip_requirements=requirements
        )
        return
    log.warning(
        "MLflow: logging only the model's weights (model_weights/weights.pt, a weights_only torch file) "
        "because %s; load them into model_fn() with torch.load(..., weights_only=True), or set "
        "mlflow_pickle_model = true to log the whole model pickled (loading a pickle runs its code)",
        reason,
    )
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "weights.pt")
        torch.save(cpu_state_dict(module), path)
        mlflow.log_artifact(path, artifact_path="model_weights")


def _param(value: Any) -> str:
    text = (
        ",".join(map(str, value)) if isinstance(value, list | tuple) else str(getattr(value, "value", value))
    )
    return text[:500]  # MLflow's limit on a param value


def tag_run(run_id: str, tags: dict[str, str]) -> None:
    """Set ``tags`` on the MLflow run ``run_id`` (a streaming fit's batch id and version);
    a failure is a warning: the version is published whatever MLflow says."""
    try:
        import mlflow

        client = mlflow.MlflowClient()
        for name, value in tags.items():
            client.set_tag(run_id, name, value)
    except Exception as exc:  # the store or the network: never worth the published version
        log.warning(
            "MLflow: tagging run %s with %s failed (%s: %s); the model is published without the tags",
            run_id,
            sorted(tags),
            type(exc).__name__,
            str(exc)[:500],
        )
