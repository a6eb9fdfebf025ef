"""``python -m sparkdl``: commands about the library itself.

    python -m sparkdl settings [--format text|markdown]
    python -m sparkdl notebook PATH [--timeout SECONDS]

``settings`` prints the table of every setting (section, name, type, default, valid
values, meaning); ``--format markdown`` is the text of docs/settings.md. ``notebook``
runs a notebook top to bottom in a Jupyter kernel (the ``notebook`` extra), in the
notebook's own folder, and prints what its cells printed; the notebook file itself is
left as it was.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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
    run = commands.add_parser("notebook", help="run a notebook top to bottom and print its output")
    run.add_argument("path", type=Path, help="the .ipynb file")
    run.add_argument("--timeout", type=float, default=600.0, help="seconds a cell may run (default 600)")
    args = parser.parse_args(argv)
    if args.command == "notebook":
        return run_notebook(args.path, args.timeout)
    from sparkdl.apps.settings import render_markdown, render_text

    sys.stdout.write(render_markdown() if args.format == "markdown" else render_text())
    return 0


def run_notebook(path: Path, timeout_s: float) -> int:
    """Execute ``path`` in its folder; print each cell's printed text; 1 if a cell failed."""
    try:
        import nbclient
        import nbformat
    except ImportError:
        sys.stderr.write("running a notebook needs the notebook extra: bash scripts/install.sh notebook\n")
        return 2
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=int(timeout_s), resources={"metadata": {"path": str(path.resolve().parent)}}
    )
    failed = None
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as exc:
        failed = exc
    for cell in notebook.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if output.output_type == "stream":
                sys.stdout.write(output.text)
    if failed is not None:
        sys.stderr.write(f"{path}: a cell failed:\n{failed}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
