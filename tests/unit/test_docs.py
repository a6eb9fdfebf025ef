"""The docs: the site builds strict, every page is in its navigation, the README stays a tour.

``mkdocs build --strict`` (with mkdocs.yml's validation settings) fails on a broken link
or anchor between docs pages and on a page under docs/ that the nav leaves out.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
# CI (.ci/run) runs this line of the README verbatim.
TEST_COMMAND = "bash scripts/install.sh test && .venv/bin/python -m pytest"
README_MAX_LINES = 220


def _nav_pages(node: object) -> list[str]:
    """Every page path named anywhere in mkdocs.yml's nav."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (site / "index.html").is_file()


def test_every_page_under_docs_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"
    listed = _nav_pages(config["nav"])
    pages = sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    missing = [page for page in pages if page not in listed]
    assert not missing, f"pages under docs/ that mkdocs.yml's nav leaves out: {missing}"
    absent = [page for page in listed if not (DOCS / page).is_file()]
    assert not absent, f"nav entries with no file under docs/: {absent}"
    assert "settings.md" in listed, "the generated settings reference must stay in the nav"


def test_the_readme_is_a_tour_of_at_most_220_lines() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; it is the tour (at most {README_MAX_LINES}): "
        "move the detail into a page under docs/guide/"
    )


def test_the_readme_holds_the_test_command_ci_runs_verbatim() -> None:
    assert TEST_COMMAND in README.read_text().splitlines()
    assert TEST_COMMAND in (ROOT / ".ci/run").read_text().splitlines()


def test_the_relative_links_of_the_readme_and_benchmarks_point_at_files() -> None:
    broken = []
    for name in ("README.md", "BENCHMARKS.md"):
        text = (ROOT / name).read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:|#", target):
                continue
            if not (ROOT / target.split("#", 1)[0]).exists():
                broken.append(f"{name}: {target}")
    assert not broken, f"links to files that do not exist: {broken}"


def test_benchmarks_md_and_the_sites_benchmarks_page_hold_the_same_table() -> None:
    root_rows = _table_rows((ROOT / "BENCHMARKS.md").read_text())
    site_rows = _table_rows((DOCS / "benchmarks/index.md").read_text())
    assert root_rows, "BENCHMARKS.md opens with the table of the figures that hold today"
    assert root_rows == site_rows, "BENCHMARKS.md and docs/benchmarks/index.md must hold one table"
