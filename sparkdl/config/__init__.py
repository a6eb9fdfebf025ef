"""Typed settings: frozen dataclasses and enums, loaded from ``conf/*.toml``.

The public face of the configuration layer: :class:`SparkDLConfig` and its sections,
the choices a setting can name, and the loaders. The pieces live in
:mod:`sparkdl.config.core` (the root config and its cross-section rules), the sections in
:mod:`sparkdl.config.training_sections`, :mod:`sparkdl.config.runtime_sections` and
:mod:`sparkdl.config.strategy_sections`, then :mod:`sparkdl.config.choices`,
:mod:`sparkdl.config.loading` and :mod:`sparkdl.config.table` (the table of every setting, for
docs and Params).
"""

from sparkdl.config.core import *  # noqa: F403 - the public names, listed once in core.__all__
from sparkdl.config.core import __all__ as __all__
