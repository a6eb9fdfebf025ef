"""The whole settings table: the library's settings and the jobs' own sections.

``python -m sparkdl settings`` prints it; docs/settings.md is its markdown form (a unit
test compares the two). The library's rows come from :mod:`sparkdl.config.table`; the
jobs' sections (``[job]``, ``[etl]``, ``[stream]``, ``[spark]``) live with the jobs in this package.
"""

from __future__ import annotations

import textwrap

from sparkdl.apps.etl_job import EtlSection
from sparkdl.apps.stream_job import StreamSection
from sparkdl.apps.train_job import JobSection, SparkSection
from sparkdl.config.table import Setting, library_settings, settings_of

REGENERATE = ".venv/bin/python -m sparkdl settings --format markdown > docs/settings.md"


def job_settings() -> tuple[Setting, ...]:
    """The jobs' own sections (``[job]``, ``[etl]``, ``[stream]``, ``[spark]``): not estimator
    settings."""
    return settings_of({"job": JobSection, "etl": EtlSection, "stream": StreamSection, "spark": SparkSection})


def render_text() -> str:
    """The table for a terminal: one block per setting, grouped by section."""
    out = [
        "sparkdl settings: a TorchEstimator keyword, a key under [section] in a TOML file,",
        "and --set section.key=value for the jobs. Precedence: default < file < --set < keyword.",
    ]
    for title, rows in (("", library_settings()), ("jobs' own sections", job_settings())):
        if title:
            out += ["", f"--- {title} (jobs/*.py config files only; not TorchEstimator keywords) ---"]
        section = ""
        for s in rows:
            if s.section != section:
                section = s.section
                out += ["", f"[{section}]"]
            out.append(f"  {s.name} = {s.default_text}    ({s.type}; {s.valid})")
            out.extend(textwrap.wrap(s.meaning, 96, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(out) + "\n"


def render_markdown() -> str:
    """docs/settings.md: a header saying how to regenerate it, then one table per section."""
    out = [
        "<!-- Generated from the settings' own metadata (sparkdl/config/*_sections.py,",
        "     sparkdl/apps/*_job.py); do not edit by hand. Regenerate with:",
        f"       {REGENERATE}",
        "     tests/unit/test_settings.py fails while this file is out of step. -->",
        "",
        "# Settings",
        "",
        "Every setting has one name that works three ways: a keyword argument of `TorchEstimator`",
        "(and a Spark ML Param of it), a key under its `[section]` in a TOML file, and a",
        "`--set section.key=value` override of the jobs. Precedence: default < file < `--set` <",
        "keyword argument. The defaults below are the library's; `conf/local.toml` is the main",
        "job's choice of values. The same table: `python -m sparkdl settings`.",
    ]
    out += _markdown_tables(library_settings())
    out += [
        "",
        "# The jobs' own sections",
        "",
        "Read by `jobs/train.py` (`[job]`, `[spark]`), `jobs/etl_to_train.py` (`[etl]`, `[spark]`) and",
        "`jobs/stream_train.py` (`[stream]`, `[spark]`) from their TOML files; not `TorchEstimator`",
        "keywords.",
    ]
    out += _markdown_tables(job_settings())
    return "\n".join(out) + "\n"


def _markdown_tables(rows: tuple[Setting, ...]) -> list[str]:
    out: list[str] = []
    section = ""
    for s in rows:
        if s.section != section:
            section = s.section
            out += ["", f"## [{section}]", "", "| setting | type | default | valid values | meaning |"]
            out.append("|---|---|---|---|---|")
        prose = [_markdown_escape(s.valid), _markdown_escape(s.meaning)]
        out.append("| " + " | ".join([f"`{s.name}`", s.type, f"`{s.default_text}`", *prose]) + " |")
    return out


def _markdown_escape(text: str) -> str:
    # a table cell: "|" would end it, and "__THIS__" would render as bold
    return text.replace("|", "\\|").replace("__", "\\_\\_")
