"""Reading and writing whole files on any path a saved model may be on (local, object
storage, HDFS, DBFS).

Local paths use Python I/O. An object store whose fsspec filesystem is installed
(``s3://``/``s3a://`` with s3fs, ``gs://`` with gcsfs, ``abfss://`` with adlfs) goes through
fsspec (:func:`object_store`), with the Spark session's ``spark.hadoop.fs.s3a.*`` conf as its
options over the environment's credentials, so the JVM needs no connector for it; other
schemes (``hdfs://``, ``dbfs:``, or an object store without its Python filesystem) go through
the JVM's Hadoop FileSystem. Large files (a model's weights) are written and read through a
local file (:func:`write_file`, :func:`local_file`): copied in a stream, never held whole
in memory by fsspec or in the JVM's heap.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from sparkdl.config.loading import SCHEME_PACKAGES, url_scheme
from sparkdl.storage.filesystems import Location, conf_options, open_url

#: Schemes written through fsspec where their filesystem's package is installed (else the JVM).
FSSPEC_SCHEMES = ("s3", "s3a", "gs", "gcs", "abfs", "abfss", "az")


def _local(path: str) -> Path | None:
    parsed = urlparse(path)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else path)
    return None


def object_store(spark: Any, path: str) -> Location | None:
    """``path`` opened through fsspec (options: the session's s3a conf; credentials else from
    the environment), or None where the JVM reaches it (local, hdfs, dbfs, or no package)."""
    scheme = url_scheme(path)
    if scheme not in FSSPEC_SCHEMES or importlib.util.find_spec(SCHEME_PACKAGES[scheme]) is None:
        return None
    return open_url(path, conf_options(spark) if scheme in ("s3", "s3a") else {}, "the model's path")


def local_path(path: str) -> Path | None:
    """``path`` as a local :class:`~pathlib.Path` (no scheme, or ``file:``); None for another
    scheme (``hdfs:``, ``s3a:``, ``dbfs:``, ...), whose files only the JVM reads."""
    return _local(path)


def write_bytes(spark: Any, path: str, data: bytes) -> None:
    """Write ``data`` to ``path``, replacing it."""
    local = _local(path)
    if local is not None:
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(local.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(local)
        return
    store = object_store(spark, path)
    if store is not None:
        store.fs.pipe_file(store.path, data)
        return
    # Hadoop (hdfs, dbfs): written beside, then renamed over it, so that a reader never
    # finds half of it (HDFS's rename is atomic; it refuses an existing target, hence the delete)
    jvm, conf = spark._jvm, spark.sparkContext._jsc.hadoopConfiguration()
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    tmp = jvm.org.apache.hadoop.fs.Path(f"{path}.tmp-{uuid.uuid4().hex[:12]}")
    filesystem = hpath.getFileSystem(conf)
    stream = filesystem.create(tmp, True)
    try:
        stream.write(bytearray(data))
    finally:
        stream.close()
    filesystem.delete(hpath, False)
    if not filesystem.rename(tmp, hpath):
        filesystem.delete(tmp, False)
        raise OSError(f"could not rename {tmp} to {path}: check the permissions of its folder")


def list_names(spark: Any, folder: str) -> list[str]:
    """The names of what ``folder`` holds (files and folders, no path); empty where it is absent."""
    local = _local(folder)
    if local is not None:
        return sorted(child.name for child in local.iterdir()) if local.is_dir() else []
    store = object_store(spark, folder)
    if store is not None:
        if not store.fs.exists(store.path):
            return []
        return sorted(
            str(child).rstrip("/").rsplit("/", 1)[-1] for child in store.fs.ls(store.path, detail=False)
        )
    jvm, conf = spark._jvm, spark.sparkContext._jsc.hadoopConfiguration()
    hpath = jvm.org.apache.hadoop.fs.Path(folder)
    filesystem = hpath.getFileSystem(conf)
    if not filesystem.exists(hpath):
        return []
    return sorted(str(status.getPath().getName()) for status in filesystem.listStatus(hpath))


def read_bytes(spark: Any, path: str) -> bytes:
    """Read the whole file at ``path``."""
    local = _local(path)
    if local is not None:
        return local.read_bytes()
    store = object_store(spark, path)
    if store is not None:
        return bytes(store.fs.cat_file(store.path))
    rows = spark.sparkContext.binaryFiles(path).collect()
    if not rows:
        raise FileNotFoundError(path)
    return bytes(rows[0][1])


def write_file(spark: Any, path: str, write: Callable[[Path], None]) -> None:
    """Have ``write`` fill a local file that then replaces ``path`` whole (a local path is
    renamed into place; another scheme is copied there by Hadoop, streamed)."""
    local = _local(path)
    if local is not None:
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(local.name + ".tmp")
        write(tmp)
        tmp.replace(local)
        return
    with tempfile.TemporaryDirectory(prefix="sparkdl-") as folder:
        tmp = Path(folder) / "file"
        write(tmp)
        store = object_store(spark, path)
        if store is not None:
            store.fs.put_file(str(tmp), store.path)
            return
        jvm, conf = spark._jvm, spark.sparkContext._jsc.hadoopConfiguration()
        hadoop_path = jvm.org.apache.hadoop.fs.Path
        target = hadoop_path(path)
        target.getFileSystem(conf).copyFromLocalFile(True, True, hadoop_path(str(tmp)), target)


@contextlib.contextmanager
def local_file(spark: Any, path: str) -> Iterator[Path]:
    """``path`` as a local file for the length of the block (another scheme is copied to a
    temporary file by Hadoop, streamed, and removed afterwards)."""
    local = _local(path)
    if local is not None:
        if not local.exists():
            raise FileNotFoundError(path)
        yield local
        return
    folder = tempfile.mkdtemp(prefix="sparkdl-")
    try:
        tmp = Path(folder) / "file"
        store = object_store(spark, path)
        if store is not None:
            store.fs.get_file(store.path, str(tmp))
            yield tmp
            return
        jvm, conf = spark._jvm, spark.sparkContext._jsc.hadoopConfiguration()
        hadoop_path = jvm.org.apache.hadoop.fs.Path
        source = hadoop_path(path)
        source.getFileSystem(conf).copyToLocalFile(False, source, hadoop_path(str(tmp)), True)
        yield tmp
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write_metadata(spark: Any, path: str, text: str, overwrite: bool) -> bool:
    """Write Spark ML's metadata line as Spark's text writer lays it out
    (``path/metadata/part-00000`` and ``_SUCCESS``, readable by ``spark.read.text`` too), through
    fsspec; False (nothing written) where the path is not an object store fsspec reaches.

    Raises:
        FileExistsError: ``path`` holds a saved stage and ``overwrite`` is False.
    """
    store = object_store(spark, path)
    if store is None:
        return False
    folder = f"{store.path.rstrip('/')}/metadata"
    if store.fs.exists(folder) and not overwrite:
        raise FileExistsError(f"{path} already holds a saved stage; save with write().overwrite().save(...)")
    store.fs.pipe_file(f"{folder}/part-00000", (text + "\n").encode())
    store.fs.pipe_file(f"{folder}/_SUCCESS", b"")
    return True


def read_metadata(spark: Any, path: str) -> str | None:
    """The metadata line :func:`write_metadata` (or Spark's text writer) wrote at ``path``;
    None where the path is not an object store fsspec reaches."""
    store = object_store(spark, path)
    if store is None:
        return None
    folder = f"{store.path.rstrip('/')}/metadata"
    listed = store.fs.ls(folder, detail=False, refresh=True)  # not a listing cached before a rewrite
    parts = sorted(p for p in listed if p.rsplit("/", 1)[-1].startswith("part-"))
    for part in parts:
        lines = bytes(store.fs.cat_file(part)).decode().splitlines()
        if lines:
            return lines[0]
    raise FileNotFoundError(f"{path}/metadata holds no part-* file with a line: not a saved Spark ML stage")


def remove_tree(spark: Any, path: str) -> bool:
    """Remove ``path`` and all below it on an object store (for ``overwrite``); False where the
    path is not an object store fsspec reaches (the JVM's overwrite handles it)."""
    store = object_store(spark, path)
    if store is None:
        return False
    if store.fs.exists(store.path):
        store.fs.rm(store.path, recursive=True)
    return True


def delete_tree(spark: Any, path: str) -> None:
    """Remove ``path`` and all below it, on any scheme (nothing when it is absent)."""
    local = _local(path)
    if local is not None:
        if local.is_dir() and not local.is_symlink():
            shutil.rmtree(local, ignore_errors=True)
        else:
            local.unlink(missing_ok=True)  # rmtree does nothing with a file
        return
    if remove_tree(spark, path):
        return
    jvm, conf = spark._jvm, spark.sparkContext._jsc.hadoopConfiguration()
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    hpath.getFileSystem(conf).delete(hpath, True)
