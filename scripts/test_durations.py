"""Each test file's seconds (setup, call and teardown of its tests) from a JUnit XML report,
as ``tests/durations.json``: the order in which the suite starts its files (longest first,
tests/conftest.py).

    .venv/bin/python -m pytest --junitxml=/tmp/junit.xml
    .venv/bin/python scripts/test_durations.py /tmp/junit.xml > tests/durations.json
"""

from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_file(classname: str) -> str:
    """``tests.spark.test_fit`` (or ``tests.spark.test_fit.TestClass``) -> ``tests/spark/test_fit.py``."""
    parts = classname.split(".")
    while parts and not (ROOT / Path(*parts).with_suffix(".py")).exists():
        parts.pop()
    if not parts:
        raise SystemExit(f"no test file for the JUnit classname {classname!r} under {ROOT}")
    return "/".join(parts) + ".py"


def main(report: str) -> None:
    seconds: dict[str, float] = collections.defaultdict(float)
    for case in ET.parse(report).iter("testcase"):
        seconds[test_file(case.get("classname", ""))] += float(case.get("time", "0"))
    ranked = sorted(seconds.items(), key=lambda kv: -kv[1])
    json.dump({path: round(s, 1) for path, s in ranked}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
