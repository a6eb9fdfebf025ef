"""The table of every setting: section, name, type, default, valid values and meaning.

Built from the section dataclasses themselves (each field's ``metadata=about(...)``), so
the table cannot drift from the code. It feeds ``TorchEstimator.explainParams()`` and the
estimator's docstring, ``python -m sparkdl settings``, and docs/settings.md (through
:mod:`sparkdl.apps.settings`, which adds the jobs' own sections).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import textwrap
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sparkdl.config import SECTIONS


@dataclass(frozen=True)
class Setting:
    """One row of the table."""

    section: str
    name: str
    type: str
    default: Any
    valid: str
    meaning: str

    @property
    def default_text(self) -> str:
        """The default as it is written in a TOML file."""
        return toml_literal(self.default)


def toml_literal(value: Any) -> str:
    """``value`` as a TOML literal: ``true``, ``"auto"``, ``["features"]``, ``25.0``."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def library_settings() -> tuple[Setting, ...]:
    """Every setting of :class:`~sparkdl.config.SparkDLConfig`, in file order."""
    return settings_of(SECTIONS)


def settings_of(sections: Mapping[str, type[Any]]) -> tuple[Setting, ...]:
    """One :class:`Setting` per field of each section dataclass."""
    rows = []
    for section, cls in sections.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            default = _default_of(f)
            rows.append(
                Setting(
                    section=section,
                    name=f.name,
                    type=_type_name(hint),
                    default=default,
                    valid=_valid_values(hint, f.metadata),
                    meaning=str(f.metadata.get("doc", "")).strip(),
                )
            )
    return tuple(rows)


def _default_of(f: dataclasses.Field[Any]) -> Any:
    factory = f.default_factory
    if factory is dataclasses.MISSING:
        return f.default
    return factory()


def missing_meanings(sections: Mapping[str, type[Any]]) -> list[str]:
    """``section.name`` of every field declared without a meaning (``about(doc)``)."""
    return [f"{s.section}.{s.name}" for s in settings_of(sections) if not s.meaning]


def _type_name(hint: Any) -> str:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "choice"
    origin = typing.get_origin(hint)
    if origin is tuple:
        return f"list of {typing.get_args(hint)[0].__name__}"
    if origin is dict:
        return "table"
    return str(hint.__name__)


def _valid_values(hint: Any, metadata: Mapping[str, Any]) -> str:
    parts = []
    if metadata.get("valid"):
        parts.append(str(metadata["valid"]))
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        parts.append("one of " + ", ".join(str(m.value) for m in hint))
    elif hint is bool:
        parts.append("true or false")
    if metadata.get("bound"):
        parts.append(str(metadata["bound"]))
    return "; ".join(parts) or f"any {_type_name(hint)}"


def param_doc(setting: Setting) -> str:
    """The doc of the estimator's Param: meaning, default, valid values and section."""
    return (
        f"{setting.meaning} Default {setting.default_text}; valid: {setting.valid}. "
        f"In a TOML file: [{setting.section}] {setting.name}."
    )


def with_settings_section(doc: str | None) -> str:
    """``doc`` (a class docstring) with a section listing every setting appended.

    The section is indented like ``doc``'s own body, which Python 3.13 strips and 3.11 keeps.
    """
    doc = doc or ""
    body = [line for line in doc.expandtabs().splitlines()[1:] if line.strip()]
    indent = " " * min((len(line) - len(line.lstrip()) for line in body), default=0)
    lines = ["", "Settings (keyword arguments; in a TOML file each goes under its [section]):", ""]
    section = ""
    for s in library_settings():
        if s.section != section:
            section = s.section
            lines.append(f"    [{section}]")
        head = f"{s.name} ({s.type}, default {s.default_text}; {s.valid}): {s.meaning}"
        lines.extend(textwrap.wrap(head, 96, initial_indent="        ", subsequent_indent="            "))
    return doc.rstrip() + "\n" + "\n".join(indent + line if line else line for line in lines) + "\n" + indent
