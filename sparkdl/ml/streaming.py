"""Structured Streaming: a model that keeps training as micro-batches arrive.

``query = df.writeStream.foreachBatch(sparkdl.fit_stream(estimator, model_dir)).option(
"checkpointLocation", ...).start()`` fits every micro-batch with ``estimator``, starting
from the version the previous batch published (``initial_model``), and publishes a new
version per batch id:

    <model_dir>/batch-000000000042/                 the TorchModel, saved with save()
    <model_dir>/batch-000000000042/_PUBLISHED.json  its manifest, written last
    <model_dir>/LATEST                              {"batch_id": 42, ...}, written after it

A version exists once its manifest does: a reader (:func:`latest_model`) follows
``LATEST`` to a version whose files are all written, never half of one. The version is
tied to the batch id and to the query's id (Spark's ``StreamingQuery.id``, kept in its
checkpoint location across restarts), which is what makes a restarted query exactly-once:
Spark replays a batch it did not commit, with the same id and rows. A replayed batch whose
version this query published is skipped (logged), so it is not trained twice; one whose fit
or save died before the manifest is trained again from the version before it, and its
leftover files are overwritten. ``LATEST`` is repaired by the replay when the process died
between the manifest and it. A ``model_dir`` holding another query's versions (a new
checkpoint location on an old directory) is refused: its batch ids start again at 0 and
would otherwise be taken for replays and skipped. A manifest or ``LATEST`` left unreadable
by a writer that died mid-file (HDFS and DBFS write in place) counts as absent: the
version is trained again, the newest version is found by listing ``model_dir``.

The optimizer starts afresh on every micro-batch (as with any ``initial_model``): the
weights carry on, Adam's moments and a schedule's position do not. Each micro-batch is
trained for the estimator's ``epochs``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from sparkdl.errors import ConfigError
from sparkdl.ml.estimator import TorchEstimator, TorchModel
from sparkdl.spark.tracking import tag_run
from sparkdl.storage import fs

log = logging.getLogger(__name__)

VERSION_PREFIX = "batch-"
MANIFEST = "_PUBLISHED.json"
LATEST = "LATEST"
#: The local property Spark sets to the query's id while it runs a micro-batch.
QUERY_ID_PROPERTY = "sql.streaming.queryId"


def version_path(model_dir: str, batch_id: int) -> str:
    """Where the version of micro-batch ``batch_id`` is saved under ``model_dir``."""
    return f"{str(model_dir).rstrip('/')}/{VERSION_PREFIX}{batch_id:012d}"


@dataclass
class BatchRecord:
    """What :class:`StreamingFit` did with one micro-batch: ``trained``, ``skipped`` (its
    version was published before: a replay) or ``empty``."""

    batch_id: int
    action: str
    version: str = ""
    seconds: float = 0.0


@dataclass
class StreamingFit:
    """The ``foreachBatch`` function of a stream that trains ``estimator`` per micro-batch
    and publishes a version per batch id under ``model_dir`` (see the module's docstring).

    Call it as Spark does, ``fit(batch_df, batch_id)``; its ``records`` say what each call
    did. It keeps the newest version's path in memory; a new instance (a restarted driver)
    finds it through ``model_dir/LATEST``.

    Args:
        estimator: the ``TorchEstimator`` each micro-batch is fitted with. The first batch
            starts from its ``initial_model`` if it has one, else from ``model_fn``'s weights;
            every later one from the version before it.
        model_dir: where the versions go: a local path, or any URL ``TorchModel.save`` writes
            to (``s3://``, ``gs://``, ``abfss://``, ``hdfs://``, ``dbfs:/``). One query per
            ``model_dir``: its batch ids are the stream's.
        keep_versions: how many of the newest versions to keep; older ones are removed after
            each publish, manifest first (a reader never loads half of one). 0 keeps them all.

    Raises:
        ConfigError: the estimator has no ``model_fn``, ``model_dir`` is empty, or
            ``keep_versions`` is negative.
    """

    estimator: TorchEstimator
    model_dir: str
    keep_versions: int = 0
    records: list[BatchRecord] = field(default_factory=list, init=False)
    _previous: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.estimator, TorchEstimator) or self.estimator.model_fn is None:
            raise ConfigError(
                f"a streaming fit needs a TorchEstimator with model_fn, not {self.estimator!r}; "
                "pass TorchEstimator(model_fn=make_model, ...)"
            )
        if not str(self.model_dir).strip():
            raise ConfigError(
                "model_dir is empty: name the directory (local or a URL) the versions are published to"
            )
        self.model_dir = str(self.model_dir).rstrip("/")
        if self.keep_versions < 0:
            raise ConfigError(
                f"keep_versions = {self.keep_versions}: keep that many of the newest versions (>= 1), "
                "or 0 to keep them all"
            )

    @property
    def trained(self) -> list[int]:
        """The batch ids this instance trained and published."""
        return [r.batch_id for r in self.records if r.action == "trained"]

    @property
    def skipped(self) -> list[int]:
        """The batch ids this instance skipped because their version was already published."""
        return [r.batch_id for r in self.records if r.action == "skipped"]

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        spark = batch_df.sparkSession
        query = query_id(spark)
        _check_same_query(read_latest(spark, self.model_dir), query, self.model_dir)
        version = version_path(self.model_dir, batch_id)
        manifest = read_manifest(spark, version)
        if manifest is not None:
            _check_same_query(manifest, query, self.model_dir)
            log.info(
                "micro-batch %d: version %s is already published (a replay after a restart): "
                "skipped, not trained twice",
                batch_id,
                version,
            )
            self._point_latest(spark, batch_id, version)
            self._previous = version
            self.records.append(BatchRecord(batch_id, "skipped", version))
            return
        if batch_df.isEmpty():
            log.info("micro-batch %d has no rows: skipped, no version published", batch_id)
            self.records.append(BatchRecord(batch_id, "empty"))
            return
        started = time.perf_counter()
        model = self._estimator_for(spark, batch_id).fit(batch_df)
        self.publish(spark, model, batch_id, time.perf_counter() - started)
        self._previous = version
        self.records.append(BatchRecord(batch_id, "trained", version, time.perf_counter() - started))

    def _estimator_for(self, spark: Any, batch_id: int) -> TorchEstimator:
        """The estimator that fits ``batch_id``: from the newest version published before it."""
        previous = self._previous or _latest_version(spark, self.model_dir, batch_id)
        base = self.estimator
        name = base.get_config().tracking.mlflow_run_name or "stream"
        estimator: TorchEstimator = base.copy({base.getParam("mlflow_run_name"): f"{name} batch {batch_id}"})
        if previous is not None:
            estimator.initial_model = previous
            log.info("micro-batch %d: training from %s", batch_id, previous)
        return estimator

    def publish(self, spark: Any, model: TorchModel, batch_id: int, fit_seconds: float) -> str:
        """Save ``model`` as ``batch_id``'s version: its files, then its manifest, then
        ``LATEST``; tag its MLflow run with the batch id. Returns the version's path."""
        version = version_path(self.model_dir, batch_id)
        model.write().overwrite().save(version)
        self.mark_published(spark, model, batch_id, fit_seconds)
        self._point_latest(spark, batch_id, version)
        if self.keep_versions:
            self.prune(spark)
        if model.mlflow_run_id:
            tag_run(
                model.mlflow_run_id,
                {"sparkdl.batch_id": str(batch_id), "sparkdl.model_version": version},
            )
        log.info("micro-batch %d: published %s (fit %.1f s)", batch_id, version, fit_seconds)
        return version

    def mark_published(self, spark: Any, model: TorchModel, batch_id: int, fit_seconds: float) -> None:
        """Write the version's manifest: from now on it exists."""
        version = version_path(self.model_dir, batch_id)
        samples = model.history[0].get("samples", 0) if model.history else 0
        manifest = {
            "batch_id": batch_id,
            "initial_model": model.initial_model,
            "samples": samples,
            "fit_seconds": fit_seconds,
            "mlflow_run_id": model.mlflow_run_id or "",
            "published_at": time.time(),
            "query_id": query_id(spark) or "",
        }
        fs.write_bytes(spark, f"{version}/{MANIFEST}", json.dumps(manifest).encode())

    def prune(self, spark: Any) -> list[int]:
        """Remove every version but the ``keep_versions`` newest published ones (and folders of
        older batches never published): each one's manifest first, then its files. Returns the
        batch ids removed."""
        batches = sorted(
            int(name[len(VERSION_PREFIX) :])
            for name in fs.list_names(spark, self.model_dir)
            if name.startswith(VERSION_PREFIX) and name[len(VERSION_PREFIX) :].isdigit()
        )
        published = [b for b in batches if read_manifest(spark, version_path(self.model_dir, b)) is not None]
        kept = published[-self.keep_versions :] if self.keep_versions else published
        oldest_kept = min(kept, default=0)
        removed = [b for b in batches if b < oldest_kept]
        for batch_id in removed:
            version = version_path(self.model_dir, batch_id)
            fs.delete_tree(spark, f"{version}/{MANIFEST}")
            fs.delete_tree(spark, version)
        if removed:
            log.info("pruned %d old version(s) under %s, kept %s", len(removed), self.model_dir, kept)
        return removed

    def _point_latest(self, spark: Any, batch_id: int, version: str) -> None:
        pointer = read_latest(spark, self.model_dir)
        if pointer is not None and int(pointer["batch_id"]) >= batch_id:
            return
        pointer = {
            "batch_id": batch_id,
            "version": version.rsplit("/", 1)[-1],
            "query_id": query_id(spark) or "",
        }
        fs.write_bytes(spark, f"{self.model_dir}/{LATEST}", json.dumps(pointer).encode())


def fit_stream(estimator: TorchEstimator, model_dir: str, keep_versions: int = 0) -> StreamingFit:
    """The ``foreachBatch`` function that trains ``estimator`` on each micro-batch of a
    stream and publishes a version per batch id under ``model_dir`` (the ``keep_versions``
    newest kept; 0: all): ``df.writeStream.foreachBatch(sparkdl.fit_stream(est,
    "s3://b/models")).option("checkpointLocation", "s3://b/checkpoint").start()``. See
    :class:`StreamingFit`."""
    return StreamingFit(estimator, model_dir, keep_versions)


def latest_model(model_dir: str, model_fn: Any = None, spark: Any = None, **functions: Any) -> TorchModel:
    """The newest version published under ``model_dir``, loaded (``TorchModel.load`` with
    ``model_fn`` and any other ``functions``).

    Raises:
        ConfigError: nothing is published there yet.
    """
    spark = spark or _active_session()
    pointer = read_latest(spark, model_dir)
    if pointer is None:
        raise ConfigError(
            f"no model version is published under {model_dir!r} yet (no readable {LATEST} file and no "
            f"{VERSION_PREFIX}* folder with a {MANIFEST} there): wait for the stream's first non-empty "
            "micro-batch, or check model_dir"
        )
    version = version_path(model_dir, int(pointer["batch_id"]))
    return TorchModel.load(version, model_fn=model_fn, **functions)


def query_id(spark: Any) -> str | None:
    """The id of the streaming query whose ``foreachBatch`` runs now (the same across its
    restarts from one checkpoint location); None outside a stream's batch."""
    try:
        value = spark.sparkContext.getLocalProperty(QUERY_ID_PROPERTY)
    except Exception:  # a Spark Connect session has no SparkContext: the id is not known there
        return None
    return str(value) if value else None


def read_latest(spark: Any, model_dir: str) -> dict[str, Any] | None:
    """``model_dir/LATEST``'s content (``batch_id``, ``version``, ``query_id``); where it is
    absent or unreadable, the newest published version found by listing ``model_dir``; None
    when nothing is published."""
    model_dir = str(model_dir).rstrip("/")
    pointer = _read_json(spark, f"{model_dir}/{LATEST}")
    if pointer is not None:
        return pointer
    for name in sorted(fs.list_names(spark, model_dir), reverse=True):
        if not name.startswith(VERSION_PREFIX) or not name[len(VERSION_PREFIX) :].isdigit():
            continue
        manifest = read_manifest(spark, f"{model_dir}/{name}")
        if manifest is not None:
            return {
                "batch_id": int(manifest["batch_id"]),
                "version": name,
                "query_id": manifest.get("query_id", ""),
            }
    return None


def read_manifest(spark: Any, version: str) -> dict[str, Any] | None:
    """The manifest of the version at ``version``, None while it is not published."""
    return _read_json(spark, f"{version}/{MANIFEST}")


def _check_same_query(record: dict[str, Any] | None, query: str | None, model_dir: str) -> None:
    """Refuse a ``model_dir`` whose ``record`` (a manifest or ``LATEST``) another query wrote.
    A record or a call without a query id (a batch fitted by hand) is not tied to one."""
    written_by = record.get("query_id") if record is not None else None
    if record is None or not written_by or query is None or written_by == query:
        return
    raise ConfigError(
        f"{model_dir} holds the versions of streaming query {written_by}, but this is query {query} "
        f"(micro-batch {record['batch_id']} there): its batch ids would be taken for replays and skipped. "
        "Give this query a new model_dir (start it from the old one's newest version with "
        "initial_model=latest_model(old_dir, ...)), or restart it from the checkpointLocation that wrote them"
    )


def _latest_version(spark: Any, model_dir: str, batch_id: int) -> str | None:
    """The newest version published before ``batch_id`` (None: none yet).

    Raises:
        ConfigError: ``model_dir`` holds a version of a later batch than ``batch_id``: it was
            written by another query (another checkpoint location).
    """
    pointer = read_latest(spark, model_dir)
    if pointer is None:
        return None
    newest = int(pointer["batch_id"])
    if newest >= batch_id:
        raise ConfigError(
            f"{model_dir} already holds the version of micro-batch {newest}, but this stream is at "
            f"micro-batch {batch_id} and has not published it: the versions there were written by "
            "another query (another checkpointLocation, or one deleted since). Give this query a "
            "new model_dir, or restart it from the checkpointLocation that wrote them"
        )
    return version_path(model_dir, newest)


def _read_json(spark: Any, path: str) -> dict[str, Any] | None:
    """The JSON object at ``path``; None when it is absent, or unreadable (logged): a writer
    that died mid-file, on a filesystem that writes in place."""
    if not _exists(spark, path):
        return None
    raw = fs.read_bytes(spark, path)
    try:
        data = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        data = error
    if not isinstance(data, dict) or "batch_id" not in data:
        log.warning("%s holds %r, not the JSON object sparkdl writes there: taken as absent", path, raw[:200])
        return None
    return data


def _exists(spark: Any, path: str) -> bool:
    local = fs.local_path(path)
    if local is not None:
        return local.exists()
    store = fs.object_store(spark, path)
    if store is not None:
        return bool(store.fs.exists(store.path))
    jvm, conf = spark._jvm, spark.sparkContext._jsc.hadoopConfiguration()
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    return bool(hadoop_path.getFileSystem(conf).exists(hadoop_path))


def _active_session() -> Any:
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is None:
        raise ConfigError("latest_model needs a SparkSession: start one first (sparkdl.session())")
    return spark
