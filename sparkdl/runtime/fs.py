"""Reading and writing whole files on any Hadoop-supported path (local, HDFS, S3, DBFS).

Local paths use Python I/O; other schemes go through the JVM's Hadoop FileSystem,
so model files land wherever Spark ML writes the model's metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse


def _local(path: str) -> Path | None:
    parsed = urlparse(path)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else path)
    return None


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
