"""Dependencies point one way: the training loop and the strategy protocol are torch only."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN = (
    "pyspark",
    "cryptography",
    "sparkdl.wire",
    "sparkdl.services.progress",
    "sparkdl.runtime",
    "sparkdl.services.ps.server",
)


@pytest.mark.parametrize("module", ["sparkdl.training.loop", "sparkdl.strategies", "sparkdl.training.hooks"])
def test_the_loop_side_imports_no_spark_no_sockets_and_no_progress_bars(module):
    code = (
        f"import sys, json; import {module}; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r}))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(done.stdout) == []


def test_choosing_a_strategy_loads_only_its_module():
    code = (
        "import sys; from sparkdl.config import Strategy; from sparkdl.strategies import strategy_class; "
        "strategy_class(Strategy.WEIGHT_AVERAGING); "
        "print('sparkdl.services.ps.client' in sys.modules, "
        "'sparkdl.strategies.weight_averaging' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["False", "True"]
