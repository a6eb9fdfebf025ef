"""A ``pyspark.ml`` Pipeline or PipelineModel saved to, and loaded from, an object store the
JVM has no connector for (issue 56): :func:`save_pipeline`, :func:`load_pipeline`.

pyspark writes a pipeline's own metadata through the JVM (``DefaultParamsWriter.saveMetadata``:
a one-row DataFrame written with ``write.text``), and a JVM stage (``VectorAssembler``, a
``StandardScalerModel``) writes itself through the JVM too; without the scheme's Hadoop
connector (hadoop-aws for ``s3a://``, the GCS connector for ``gs://``) both fail, and so does
reading. Here the same folder is written through fsspec instead: the pipeline's metadata line
as pyspark writes it (``metadata/part-00000``), sparkdl's stages by their own writers (which
reach object stores through fsspec already), and every other stage by its own writer into a
local folder, then uploaded as it is. Loading reads the metadata through fsspec, loads
sparkdl's stages from the store and every other stage from a downloaded copy.

The folder is pyspark's own layout (``stages/<index>_<uid>``), so ``PipelineModel.load`` reads
it where the JVM has the connector, and :func:`load_pipeline` reads one pyspark wrote. A path
fsspec does not reach (local, ``hdfs://``, ``dbfs:``, an object store whose Python filesystem is
not installed) goes to pyspark's own writer and reader. A JVM stage saves and loads through its
executors, so it is staged on a local master's disk only: on a cluster's master a pipeline
with JVM stages is refused, naming them (sparkdl's own stages go anywhere).
"""

from __future__ import annotations

import importlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Any, cast

from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.pipeline import PipelineSharedReadWrite
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter
from pyspark.sql import SparkSession

from sparkdl.errors import ConfigError
from sparkdl.storage import fs

log = logging.getLogger(__name__)

_KINDS: dict[str, type[Pipeline] | type[PipelineModel]] = {
    "pyspark.ml.pipeline.Pipeline": Pipeline,
    "pyspark.ml.pipeline.PipelineModel": PipelineModel,
    "org.apache.spark.ml.Pipeline": Pipeline,  # written by the JVM's writer (every stage a JVM one)
    "org.apache.spark.ml.PipelineModel": PipelineModel,
}


def save_pipeline(pipeline: Pipeline | PipelineModel, path: str, overwrite: bool = False) -> None:
    """Save ``pipeline`` at ``path`` in pyspark's layout, through fsspec where it reaches the
    path (no JVM connector needed), else with pyspark's own writer.

    Raises:
        FileExistsError: ``path`` holds a saved stage and ``overwrite`` is False.
        ConfigError: a stage cannot be saved (it is not ``MLWritable``).
    """
    spark = SparkSession.active()
    path = path.rstrip("/")
    stages: list[Any] = list(pipeline.getStages() if isinstance(pipeline, Pipeline) else pipeline.stages)
    store = fs.object_store(spark, path)
    if store is None:
        writer = pipeline.write()
        (writer.overwrite() if overwrite else writer).save(path)
        return
    for stage in stages:
        if not hasattr(stage, "write"):
            raise ConfigError(
                f"stage {stage.uid} ({type(stage).__name__}) of the pipeline cannot be saved: it is not "
                "MLWritable; give it a writer (pyspark.ml.util.DefaultParamsWritable) or leave it out"
            )
    _refuse_jvm_stages_off_this_machine(spark, [s for s in stages if not _reaches_object_stores(type(s))])
    if overwrite:
        fs.remove_tree(spark, path)
    elif store.fs.glob(store.child("metadata/part-*")):  # pyspark's: part-00000-<uuid>.txt
        raise FileExistsError(
            f"{path} already holds a saved pipeline or stage; save_pipeline(..., overwrite=True) replaces it"
        )
    uids = [stage.uid for stage in stages]
    text = DefaultParamsWriter._get_metadata_to_save(
        pipeline, spark, paramMap={"stageUids": uids, "language": "Python"}
    )
    fs.write_metadata(spark, path, text, overwrite=True)
    for index, stage in enumerate(stages):
        relative = PipelineSharedReadWrite.getStagePath(stage.uid, index, len(stages), "stages")
        where = f"{path}/{relative}"
        if _reaches_object_stores(type(stage)):
            writer = stage.write().session(spark)
            (writer.overwrite() if overwrite else writer).save(where)  # a store may keep emptied folders
            continue
        with tempfile.TemporaryDirectory(prefix="sparkdl-stage-") as folder:
            local = str(Path(folder, "stage"))
            stage.write().session(spark).save(local)  # through the JVM, to this machine's disk
            store.fs.put(f"{local}/", f"{store.child(relative)}/", recursive=True)  # its files, into it
    log.info("saved the pipeline %s (%d stages) to %s through fsspec", pipeline.uid, len(stages), path)


def load_pipeline(path: str) -> Pipeline | PipelineModel:
    """The Pipeline or PipelineModel saved at ``path`` (by :func:`save_pipeline` or by
    pyspark), read through fsspec where it reaches the path, else with pyspark's reader.

    Raises:
        ConfigError: ``path`` holds no saved Pipeline or PipelineModel.
    """
    spark = SparkSession.active()
    path = path.rstrip("/")
    store = fs.object_store(spark, path)
    if store is None:
        kind = _KINDS.get(DefaultParamsReader.loadMetadata(path, spark)["class"])
        if kind is None:
            raise ConfigError(f"{path} holds no saved Pipeline or PipelineModel")
        return kind.load(path)
    metadata = json.loads(cast(str, fs.read_metadata(spark, path)))
    kind = _KINDS.get(metadata.get("class", ""))
    if kind is None:
        raise ConfigError(
            f"{path} holds a saved {metadata.get('class')!r}, not a Pipeline or PipelineModel: load it "
            "with its own class's load"
        )
    uids = metadata["paramMap"]["stageUids"]
    stages = []
    for index, uid in enumerate(uids):
        relative = PipelineSharedReadWrite.getStagePath(uid, index, len(uids), "stages")
        where = f"{path}/{relative}"
        cls = _stage_class(json.loads(cast(str, fs.read_metadata(spark, where)))["class"])
        if _reaches_object_stores(cls):
            stages.append(cls.load(where))
            continue
        _refuse_jvm_stages_off_this_machine(spark, [cls])
        with tempfile.TemporaryDirectory(prefix="sparkdl-stage-") as folder:
            local = str(Path(folder, "stage"))
            store.fs.get(f"{store.child(relative)}/", f"{local}/", recursive=True)
            stages.append(cls.load(local))  # read whole into the JVM (or Python) before the copy goes
    if kind is Pipeline:
        loaded: Pipeline | PipelineModel = Pipeline(stages=stages)
    else:
        loaded = PipelineModel(stages)
    loaded._resetUid(metadata["uid"])
    return loaded


def _refuse_jvm_stages_off_this_machine(spark: Any, jvm_stages: list[Any]) -> None:
    """A JVM stage saves and loads through its executors (a DataFrame written or read), so
    the local folder it goes through must be the driver's disk too: a local master's.

    Raises:
        ConfigError: stages that would go through a folder on other machines' disks.
    """
    master = spark.sparkContext.master
    if jvm_stages and not master.startswith("local"):
        names = ", ".join(sorted({getattr(s, "__name__", type(s).__name__) for s in jvm_stages}))
        raise ConfigError(
            f"the pipeline's JVM stages ({names}) save and load through their executors, which on "
            f"{master} do not share the driver's disk that save_pipeline stages them on: give the JVM "
            "the object store's Hadoop connector and use the pipeline's own write().save / load, or "
            "save the sparkdl stages alone with save_pipeline"
        )


def _reaches_object_stores(cls: type) -> bool:
    """Whether ``cls`` saves and loads through fsspec itself (sparkdl's stages)."""
    return cls.__module__.startswith("sparkdl.")


def _stage_class(name: str) -> Any:
    """The Python class a stage's metadata names (a JVM class's pyspark twin, as pyspark's
    reader maps it)."""
    if name.startswith("org.apache.spark"):
        name = name.replace("org.apache.spark", "pyspark")
    module, _, attribute = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"a stage of the saved pipeline is a {name}, which this Python cannot import: {exc}"
        ) from exc
