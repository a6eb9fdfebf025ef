"""The tree is the architecture: layers import only downward, nothing but the Spark-side
layers imports pyspark, and no two modules of a package import each other in a cycle.

The contracts live in pyproject.toml (``[tool.importlinter]``); import-linter checks them
against the real import graph, function-level and ``TYPE_CHECKING`` imports included.
"""

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 3 kept, 0 broken." in done.stdout


def test_every_package_of_sparkdl_is_in_a_layer():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c["layers"] for c in config["contracts"] if c["type"] == "layers")
    named = {name.strip() for layer in layers for name in layer.split("|")}
    packages = {f"sparkdl.{path.parent.name}" for path in (ROOT / "sparkdl").glob("*/__init__.py")}
    packages |= {"sparkdl.errors", "sparkdl.process"}  # the bottom layer's two modules
    assert packages == named, (
        f"packages not in a layer: {packages - named}; layers naming nothing: {named - packages}"
    )


def test_only_the_bottom_layers_and_the_entry_points_sit_loose_at_the_top():
    loose = sorted(path.name for path in (ROOT / "sparkdl").glob("*.py"))
    # estimator.py is the 0.1 class path that saved models name (tests/spark/test_saved_models.py)
    assert loose == ["__init__.py", "__main__.py", "errors.py", "estimator.py", "process.py"]
