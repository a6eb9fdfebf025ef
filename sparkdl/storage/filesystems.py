"""Where a path's files live: this machine's disk, or another filesystem reached through fsspec.

A local path (or ``file://``) stays a :class:`~pathlib.Path`, read and written with plain
file operations. A URL (``s3://``, ``gs://``, ``abfss://``, ``hdfs://``) is opened with
``fsspec.core.url_to_fs``, given the run's storage options: ``reliability.storage_options``
over the driver's ``spark.hadoop.fs.s3a.*`` conf (merged on the driver and carried to the
tasks in their settings, see :func:`s3a_options`), over what the filesystem finds itself
(s3fs: ``AWS_*`` variables, ``~/.aws``, the instance's role). ``dbfs:/x`` is Databricks'
``/dbfs/x`` mount. The options are credentials: nothing here logs them or puts them in
an error (errors name the option keys, never their values).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from sparkdl.config.loading import SCHEME_PACKAGES, check_storage_path, url_scheme
from sparkdl.errors import CheckpointError, ConfigError

#: Spark's s3a settings (after ``spark.hadoop.``) and the s3fs option each becomes.
S3A_KEYS: dict[str, str] = {
    "fs.s3a.access.key": "key",
    "fs.s3a.secret.key": "secret",
    "fs.s3a.session.token": "token",
    "fs.s3a.endpoint": "endpoint_url",
    "fs.s3a.endpoint.region": "region_name",
}

#: Environment variables s3fs (botocore) reads credentials from, named in a credentials error.
_AWS_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
)


def s3a_options(conf: Mapping[str, str]) -> dict[str, str]:
    """The s3fs options Spark's ``spark.hadoop.fs.s3a.*`` settings in ``conf`` give.

    An endpoint without a scheme gets ``https://`` (``http://`` where
    ``fs.s3a.connection.ssl.enabled`` is false), as the s3a connector reads it.
    """
    options = {
        option: conf[f"spark.hadoop.{key}"]
        for key, option in S3A_KEYS.items()
        if conf.get(f"spark.hadoop.{key}")
    }
    endpoint = options.get("endpoint_url", "")
    if endpoint and "://" not in endpoint:
        ssl = conf.get("spark.hadoop.fs.s3a.connection.ssl.enabled", "true").lower() != "false"
        options["endpoint_url"] = ("https://" if ssl else "http://") + endpoint
    return options


def conf_options(spark: Any) -> dict[str, str]:
    """The s3fs options a Spark session's conf gives (its ``spark.hadoop.fs.s3a.*``, set at
    start or with ``spark.conf.set``); {} where it has none or the conf cannot be read."""
    try:
        conf = dict(spark.conf.getAll)
    except Exception:
        try:
            conf = dict(spark.sparkContext.getConf().getAll())
        except Exception:
            return {}
    return s3a_options(conf)


def is_url(path: str) -> bool:
    """Whether ``path`` is reached through fsspec (a URL other than ``file://`` and ``dbfs:/``)."""
    return url_scheme(path) not in ("", "file", "dbfs")


def local_path(path: str) -> Path | None:
    """``path`` as a local :class:`~pathlib.Path` (no scheme, ``file://``, or ``dbfs:/x``,
    which is ``/dbfs/x``); None for a URL fsspec reaches."""
    scheme = url_scheme(path)
    if scheme == "":
        return Path(path)
    if scheme == "file":
        return Path(urlparse(path).path)
    if scheme == "dbfs":
        return Path("/dbfs") / path[len("dbfs:") :].lstrip("/")
    return None


class PathWithOptions(str):
    """A path that carries the storage options to open it with, for code that takes a path as
    a plain ``str`` (the parameter server's snapshot directory). Its repr is the path alone."""

    storage_options: dict[str, str]

    def __new__(cls, path: str, options: Mapping[str, str]) -> PathWithOptions:
        made = super().__new__(cls, path)
        made.storage_options = dict(options)
        return made

    def __reduce__(self) -> tuple[Any, ...]:
        return (PathWithOptions, (str(self), self.storage_options))

    def __repr__(self) -> str:
        return repr(str(self))


@dataclass(frozen=True)
class Location:
    """A directory or file on a filesystem fsspec reaches: the filesystem and the path on it."""

    fs: Any  # fsspec.AbstractFileSystem (fsspec is optional: not imported at module level)
    path: str
    url: str
    option_keys: tuple[str, ...] = field(default=())

    def child(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"


def open_url(url: str, options: Mapping[str, str], setting: str = "path") -> Location:
    """The filesystem and path of ``url``, opened with ``options``.

    Raises:
        ConfigError: the scheme has no filesystem installed (the package named) or the options
            do not fit its filesystem (the keys named).
    """
    check_storage_path(url, setting)
    from fsspec.core import url_to_fs

    scheme = url_scheme(url)
    try:
        fs, path = url_to_fs(url, **options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{setting} = {url!r}: its filesystem refused the storage options (keys "
            f"{sorted(options)}): {type(exc).__name__}: {str(exc)[:200]}; fix "
            "reliability.storage_options"
        ) from exc
    except ImportError as exc:
        package = SCHEME_PACKAGES.get(scheme, "its filesystem's package")
        raise ConfigError(f"{setting} = {url!r} needs {package}: pip install {package} ({exc})") from exc
    return Location(fs, str(path), url, tuple(sorted(options)))


def tried_sources(location: Location) -> str:
    """The credential sources tried for ``location``, in words (no values)."""
    given = ", ".join(location.option_keys) or "none"
    env = ", ".join(f"{name} {'set' if os.environ.get(name) else 'unset'}" for name in _AWS_ENV)
    return (
        f"storage options given (reliability.storage_options over the driver's spark.hadoop.fs.s3a.*): "
        f"keys {given}; environment: {env}; then the filesystem's own (~/.aws, the instance's role)"
    )


def access_error(location: Location, what: str, exc: BaseException) -> CheckpointError:
    """A :class:`CheckpointError` for ``what`` failing on ``location``: denied or no
    credentials name the sources tried; others say what failed."""
    text = f"{type(exc).__name__}: {str(exc)[:300]}"
    if isinstance(exc, PermissionError) or "credential" in text.lower() or "AccessDenied" in text:
        return CheckpointError(
            f"could not {what} {location.url}: {text}. Credentials were refused or missing; tried: "
            f"{tried_sources(location)}. Set reliability.storage_options (key, secret, endpoint_url), "
            "spark.hadoop.fs.s3a.access.key/secret.key/endpoint, or the AWS_* variables"
        )
    return CheckpointError(f"could not {what} {location.url}: {text}; check the path and the store")
