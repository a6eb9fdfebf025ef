"""``python -m sparkdl``: commands about the library itself.

    python -m sparkdl settings [--format text|markdown]

prints the table of every setting (section, name, type, default, valid values,
meaning); ``--format markdown`` is the text of docs/settings.md.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m sparkdl", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    show = commands.add_parser("settings", help="print every setting with its default and meaning")
    show.add_argument(
        "--format",
        choices=("text", "markdown"),
        default="text",
        help="text for a terminal (default), markdown for docs/settings.md",
    )
    args = parser.parse_args(argv)
    from sparkdl.settings import render_markdown, render_text

    sys.stdout.write(render_markdown() if args.format == "markdown" else render_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
