"""The machinery behind :mod:`sparkdl.config`: declaring settings, reading TOML, building sections.

Generic over frozen dataclasses (one per ``[section]``), so the jobs' own sections
(``[job]``, ``[etl]``, ``[spark]``) are read by the same code as the library's.

* :func:`about` is a field's metadata: its meaning (``doc``) and its valid values, kept
  next to the field so the settings table (:mod:`sparkdl.config.table`) is generated from them.
* :func:`section_owners` maps each setting name to its section and refuses a name
  declared twice: the flat surface (keyword arguments, ``replace``) needs one owner per name.
* :func:`config_from_tables` builds sections from raw TOML tables; an unknown key says
  which section it belongs in, or which name was probably meant. An error names where the
  setting came from: the file, or the ``--set`` option (:func:`override_origins`) that gave it.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib.util
import math
import os
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import tomllib

from sparkdl.errors import ConfigError

T = TypeVar("T")

BOUNDS = ("> 0", ">= 0")  # the numeric bounds a setting can declare and check_bounds enforces


def about(doc: str, *, bound: str = "", valid: str = "") -> dict[str, str]:
    """The metadata of a setting: ``field(default=..., metadata=about(...))``.

    Args:
        doc: one sentence saying what the setting does; shown by ``explainParams``,
            ``python -m sparkdl settings`` and docs/settings.md.
        bound: ``"> 0"`` or ``">= 0"``, enforced by :func:`check_bounds`.
        valid: the valid values in words, where the type and bound do not say it all.
    """
    if bound and bound not in BOUNDS:
        raise ValueError(f"bound {bound!r} is not one of {BOUNDS}")
    return {"doc": doc, "bound": bound, "valid": valid}


def check_bounds(obj: Any, section: str) -> None:
    """Enforce every ``bound`` declared with :func:`about` on the section ``obj``.

    Raises:
        ConfigError: naming ``section.name``, the value and the bound.
    """
    for f in dataclasses.fields(obj):
        bound, value = f.metadata.get("bound", ""), getattr(obj, f.name)
        if bound and isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{section}.{f.name} = {value} must be a finite number {bound}")
        if (bound == "> 0" and value <= 0) or (bound == ">= 0" and value < 0):
            raise ConfigError(f"{section}.{f.name} = {value} must be {bound}")


def url_scheme(value: str) -> str:
    """The scheme of ``value`` (``s3``, ``gs``, ``dbfs``, ...), lower case; "" for a local path.

    ``dbfs:/x`` (one slash, as Databricks writes it) counts as a URL; a Windows drive
    (``C:\\x``) does not."""
    head, separator, _ = value.partition(":")
    if (
        not separator
        or len(head) < 2
        or not head.replace("+", "").replace(".", "").replace("-", "").isalnum()
    ):
        return ""
    return head.lower() if value[len(head) + 1 :].startswith("/") else ""


#: The package that gives fsspec each scheme's filesystem (what to install when it is missing).
SCHEME_PACKAGES: dict[str, str] = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "az": "adlfs",
    "hdfs": "pyarrow",
}


def check_local_directory(value: str, setting: str) -> None:
    """Refuse a URL where a directory must be local: the epoch cache memory-maps its files
    (``numpy.memmap``), which an object store cannot serve, and a URL would be taken for a
    relative path (a folder named ``s3:`` in each process's working directory).

    Raises:
        ConfigError: ``value`` has a scheme (``s3://``, ``gs://``, ``hdfs://``, ``file://``, ...).
    """
    scheme = url_scheme(value)
    if not scheme:
        return
    if scheme == "file":
        raise ConfigError(f"{setting} = {value!r}: give the path itself, without file://")
    raise ConfigError(
        f"{setting} = {value!r} is a URL, but this directory must be on each executor's local disk: "
        f"its files are memory-mapped, which {scheme}:// cannot serve. Leave it empty (the executors' "
        "SPARK_LOCAL_DIRS) or give a local path; checkpoints and models, not this cache, go to "
        "object storage"
    )


def check_storage_path(value: str, setting: str) -> None:
    """Check that ``value`` is a local path or a URL whose filesystem is installed here
    (through fsspec): ``s3://`` needs s3fs, ``gs://`` gcsfs, ``abfss://`` adlfs, ``hdfs://``
    pyarrow with Hadoop's native library, ``dbfs:/`` Databricks' ``/dbfs`` mount.

    Raises:
        ConfigError: a scheme fsspec does not know, or whose package is not installed (named).
    """
    scheme = url_scheme(value)
    if scheme in ("", "file"):
        return
    if scheme == "dbfs":
        if not os.path.isdir("/dbfs"):
            raise ConfigError(
                f"{setting} = {value!r}: dbfs:/ paths are reached through Databricks' /dbfs mount, "
                "which this machine lacks; on Databricks it is there, elsewhere use the storage the "
                "workspace keeps DBFS on (s3://, abfss://, gs://)"
            )
        return
    try:
        from fsspec.registry import known_implementations
    except ImportError as exc:
        raise ConfigError(
            f"{setting} = {value!r} needs fsspec and {SCHEME_PACKAGES.get(scheme, 'its filesystem')}: "
            "pip install 'sparkdl-torch[storage]'"
        ) from exc
    known = known_implementations.get(scheme, {}).get("class") or (
        "adlfs.AzureBlobFileSystem" if scheme == "abfss" else ""
    )
    if not known:
        raise ConfigError(
            f"{setting} = {value!r}: no filesystem is known for {scheme}://; use a local path or one "
            f"of {', '.join(sorted(SCHEME_PACKAGES))}://, dbfs:/"
        )
    package = SCHEME_PACKAGES.get(scheme, known.split(".")[0])
    if importlib.util.find_spec(known.split(".")[0]) is None:
        raise ConfigError(
            f"{setting} = {value!r}: {scheme}:// needs the {package} package, which is not installed; "
            f"pip install {package} (on the driver and every executor)"
        )


def section_owners(sections: Mapping[str, type[Any]]) -> dict[str, str]:
    """Map each setting name to the one section that declares it.

    Raises:
        ConfigError: a name is declared by two sections (both are named).
    """
    owners: dict[str, str] = {}
    for section, cls in sections.items():
        for f in dataclasses.fields(cls):
            if f.name in owners:
                raise ConfigError(
                    f"setting {f.name!r} is declared in both [{owners[f.name]}] and [{section}]; "
                    "a setting name must be unique across sections (keyword arguments and "
                    "SparkDLConfig.replace name settings without their section): rename one"
                )
            owners[f.name] = section
    return owners


def unknown_names(kind: str, names: Iterable[str], valid: Iterable[str]) -> str:
    """Say which names are unknown: ``unknown setting 'batch_sise'; did you mean 'batch_size'?``.

    A name with a close match gets that match alone; the valid names are listed (once)
    only for names that resemble none of them.
    """
    choices = sorted(valid)
    guesses, strangers = [], []
    for name in names:
        close = difflib.get_close_matches(name, choices, n=1, cutoff=0.75)
        if close:
            guesses.append(f"unknown {kind} {name!r}; did you mean {close[0]!r}?")
        else:
            strangers.append(repr(name))
    if strangers:
        listed = f"unknown {kind}(s) {', '.join(strangers)}; valid {kind}s: {', '.join(choices)}"
        guesses.append(listed)
    return "; ".join(guesses)


def load_toml(path: str | Path, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """Read a TOML file and apply ``section.key=value`` overrides to the raw tables.

    Raises:
        ConfigError: the file is missing or not TOML, or an override is malformed.
    """
    path = Path(path)
    try:
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    for item in overrides:
        section, key, value = parse_override(item)
        raw.setdefault(section, {})[key] = value
    return raw


def parse_override(item: str) -> tuple[str, str, Any]:
    """Parse ``section.key=value``; the value is read as TOML, else taken as a string."""
    name, sep, text = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"override {item!r} is not of the form section.key=value (e.g. training.epochs=3)")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return section, key.strip(), value


def override_origins(overrides: Iterable[str]) -> dict[tuple[str, str], str]:
    """Map each ``(section, key)`` that a ``section.key=value`` override sets to that override.

    The last override of a key wins, as in :func:`load_toml`. Given to :func:`config_from_tables`,
    so that an error about such a key names the ``--set`` option rather than the file.

    Raises:
        ConfigError: an override is malformed.
    """
    origins = {}
    for item in overrides:
        section, key, _ = parse_override(item)
        origins[(section, key)] = item.strip()
    return origins


def config_from_tables(
    raw: Mapping[str, Any],
    source: str,
    sections: Mapping[str, type[Any]],
    set_by: Mapping[tuple[str, str], str] | None = None,
) -> dict[str, Any]:
    """Build one dataclass per expected section from raw TOML tables.

    Args:
        raw: the tables, the file's with the overrides applied (:func:`load_toml`).
        source: the file the tables came from, named by errors about its settings.
        sections: the dataclass of each expected section, by name.
        set_by: the overrides that set a ``(section, key)`` (:func:`override_origins`);
            errors about those keys name the ``--set`` option instead of ``source``.

    Raises:
        ConfigError: an unknown section, a key in the wrong or no section, a bad value.
    """
    set_by = set_by or {}
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        by_origin: dict[str, list[str]] = {}
        for name in unknown:
            given = [f"--set {item}" for (section, _), item in set_by.items() if section == name]
            by_origin.setdefault(", ".join(given) or source, []).append(name)
        raise ConfigError(
            "; ".join(
                f"{origin}: {unknown_names('section', names, sections)}"
                for origin, names in by_origin.items()
            )
        )
    owners: dict[str, str] = {}
    for name, cls in sections.items():
        for f in dataclasses.fields(cls):
            owners.setdefault(f.name, name)
    out = {}
    for name, cls in sections.items():
        table = raw.get(name, {})
        if not isinstance(table, Mapping):
            raise ConfigError(f"{source}: [{name}] must be a table, got {table!r}")
        out[name] = build_section(cls, table, source, name, owners, set_by)
    return out


def build_section(
    cls: type[T],
    table: Mapping[str, Any],
    source: str,
    section: str,
    owners: Mapping[str, str],
    set_by: Mapping[tuple[str, str], str] | None = None,
) -> T:
    """Build section ``cls`` from ``table``, coercing values to the fields' types.

    ``owners`` maps the names of the other sections' settings to their section, so a
    key in the wrong section is reported with the section it belongs in. ``set_by``
    names the override that gave a key (see :func:`config_from_tables`).
    """
    set_by = set_by or {}
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise ConfigError(
            "; ".join(
                _misplaced_override(key, set_by[(section, key)], section, names, owners)
                if (section, key) in set_by
                else _misplaced(key, source, section, names, owners)
                for key in unknown
            )
        )
    kwargs = {k: _coerce(v, hints[k], _where(k, source, section, set_by)) for k, v in table.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:  # a rule of the section: say which of its values the command line gave
        given = [set_by[(section, k)] for k in table if (section, k) in set_by]
        if not given:
            raise
        others = f"; the others come from {source}" if source else ""
        raise ConfigError(f"{exc} ([{section}] settings given by --set: {', '.join(given)}{others})") from exc


def _where(key: str, source: str, section: str, set_by: Mapping[tuple[str, str], str]) -> str:
    """Where the value of ``section.key`` came from, to open an error about it."""
    if (section, key) in set_by:
        return f"--set {set_by[(section, key)]}: {section}.{key}"
    return f"{source} [{section}] {key}" if source else f"[{section}] {key}"


def _probable(
    key: str, section: str, names: list[str], owners: Mapping[str, str]
) -> tuple[bool, str, str] | None:
    """What ``key`` under ``[section]`` probably meant, as ``(moved, owner, name)``: the same
    key of another section (``moved``), else the closest name of this section, else of any;
    None where nothing is close."""
    owner = owners.get(key)
    if owner is not None and owner != section:
        return True, owner, key
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
    if close:
        return False, section, close[0]
    elsewhere = difflib.get_close_matches(key, list(owners), n=1, cutoff=0.75)
    if elsewhere:
        return False, owners[elsewhere[0]], elsewhere[0]
    return None


def _meant(owner: str, name: str, section: str) -> str:
    """A close name as a message says it: quoted in its own section, else with its section."""
    return repr(name) if owner == section else f"{owner}.{name}"


def _misplaced_override(
    key: str, item: str, section: str, names: list[str], owners: Mapping[str, str]
) -> str:
    """Why the override ``item`` (``section.key=value``) names no key of ``[section]``, and the
    ``--set`` option that was probably meant."""
    value = item.partition("=")[2].strip()
    unknown = f"--set {item}: unknown key {key!r} in [{section}]"
    found = _probable(key, section, names, owners)
    if found is None:
        return f"{unknown}; valid keys: {', '.join(sorted(names))}"
    moved, owner, name = found
    if moved:
        return f"--set {item}: {key} belongs in [{owner}]; write --set {owner}.{key}={value}"
    return f"{unknown}; did you mean {_meant(owner, name, section)}? (--set {owner}.{name}={value})"


def _misplaced(key: str, source: str, section: str, names: list[str], owners: Mapping[str, str]) -> str:
    """Why ``key`` is not a key of ``[section]``: it belongs elsewhere, or a close name was meant."""
    unknown = f"{source} [{section}]: unknown key {key!r}"
    found = _probable(key, section, names, owners)
    if found is None:
        return f"{unknown}; valid keys: {', '.join(sorted(names))}"
    moved, owner, name = found
    if moved:
        return (
            f"{source}: {section}.{key}: {key} belongs in [{owner}] "
            f"(write it under [{owner}], or --set {owner}.{key}=...)"
        )
    return f"{unknown}; did you mean {_meant(owner, name, section)}?"


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        text = str(value).lower() if isinstance(value, bool | str) else value
        if isinstance(value, hint):
            return value
        try:
            return hint(text)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in hint)
            raise ConfigError(f"{where} = {value!r} is not valid; choose one of {choices}") from None
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} = {value!r} must be a list")
        (item_type, _) = typing.get_args(hint)
        return tuple(_coerce(v, item_type, where) for v in value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} = {value!r} must be a table")
        (_, value_type) = typing.get_args(hint)
        return {str(k): _coerce(v, value_type, f"{where}.{k}") for k, v in value.items()}
    if origin in (types.UnionType, typing.Union):
        members: tuple[Any, ...] = typing.get_args(hint)
        if str in members and isinstance(value, str):
            return value
        for member in members:
            if typing.get_origin(member) is tuple and isinstance(value, list | tuple):
                return _coerce(value, member, where)
        names = " or ".join(_hint_name(m) for m in members)
        raise ConfigError(f"{where} = {value!r} must be {names}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not _is_exact(value, hint):
        raise ConfigError(f"{where} = {value!r} must be of type {hint.__name__}")
    return value


def _hint_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return f"a list of {typing.get_args(hint)[0].__name__}"
    return f"a {getattr(hint, '__name__', hint)}"


def _is_exact(value: Any, hint: type) -> bool:
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)
