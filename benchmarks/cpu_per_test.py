"""A pytest plugin: the CPU seconds each test used, its whole process tree included.

The suite runs CPU-bound on 2 cores (both busy the whole run), so its time falls only with
the CPU work cut; a test's wall time says little about that (it waits, or it is slowed by the
others). Each test's process tree (the xdist worker, its JVM, the Python workers, drills'
subprocesses) is moved into a cgroup of its own (v1 ``cpuacct``) when the test starts;
what the test leaves running, and whatever it forked, keeps charging that cgroup. The
totals are read when the session ends::

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -p cpu_per_test   # root, cgroup v1 cpuacct
    # -> benchmarks/results/cpu_per_test.jsonl: {"test", "cpu", "wall"} per test

On session 34's tree the cgroups held 2,035 of the run's 2,169 CPU seconds (the rest: pytest's
controller and the machine's own). Does nothing where ``/sys/fs/cgroup/cpuacct`` is not writable.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

BASE = Path("/sys/fs/cgroup/cpuacct/sparkdl_cpu_per_test")
OUT = Path(os.environ.get("CPU_PER_TEST_OUT", Path(__file__).parent / "results" / "cpu_per_test.jsonl"))
_records: list[tuple[str, Path, float]] = []


def _enabled() -> bool:
    try:
        BASE.mkdir(exist_ok=True)
    except OSError:
        return False
    return True


def _tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rfind(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, todo = [root], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _move_tree(group: Path) -> None:
    for pid in _tree(os.getpid()):
        try:
            (group / "cgroup.procs").write_text(str(pid))
        except OSError:  # it ended meanwhile
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not _enabled():
        yield
        return
    group = BASE / f"{os.getpid()}-{len(_records)}"
    group.mkdir(exist_ok=True)
    _move_tree(group)
    started = time.monotonic()
    yield
    _records.append((item.nodeid, group, time.monotonic() - started))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not _records:
        return
    rest = BASE / f"{os.getpid()}-end"
    rest.mkdir(exist_ok=True)
    _move_tree(rest)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("a") as out:
        for nodeid, group, wall in _records:
            cpu = int((group / "cpuacct.usage").read_text()) / 1e9
            out.write(json.dumps({"test": nodeid, "cpu": round(cpu, 3), "wall": round(wall, 3)}) + "\n")
