"""Reading and writing whole files on any Hadoop-supported path (local, HDFS, S3, DBFS).

Local paths use Python I/O; other schemes go through the JVM's Hadoop FileSystem,
so model files land wherever Spark ML writes the model's metadata. Large files (a
model's weights) are written and read through a local file (:func:`write_file`,
:func:`local_file`): Hadoop copies it in a stream, never holding it in the JVM's heap.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse


def _local(path: str) -> Path | None:
    parsed = urlparse(path)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else path)
    return None


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
    jvm, conf = spark._jvm, spark.sparkContext._jsc.hadoopConfiguration()
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    stream = hpath.getFileSystem(conf).create(hpath, True)
    try:
        stream.write(bytearray(data))
    finally:
        stream.close()


def read_bytes(spark: Any, path: str) -> bytes:
    """Read the whole file at ``path``."""
    local = _local(path)
    if local is not None:
        return local.read_bytes()
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
        jvm, conf = spark._jvm, spark.sparkContext._jsc.hadoopConfiguration()
        hadoop_path = jvm.org.apache.hadoop.fs.Path
        source = hadoop_path(path)
        source.getFileSystem(conf).copyToLocalFile(False, source, hadoop_path(str(tmp)), True)
        yield tmp
    finally:
        shutil.rmtree(folder, ignore_errors=True)
