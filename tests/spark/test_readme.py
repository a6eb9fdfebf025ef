"""The README's Python example runs as written and gives what it says."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from tests.spark.processes import ROOT, spark_env

pytestmark = pytest.mark.spark


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use it from Python", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "the README's 'Use it from Python' section has no Python block"
    return match.group(1)


def test_the_readme_example_trains_to_the_accuracy_it_shows_and_saves_plain_torch_weights(tmp_path):
    script = tmp_path / "digits.py"
    script.write_text(readme_example())
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=spark_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (accuracy,) = re.findall(r"^accuracy ([0-9.]+)$", done.stdout, re.MULTILINE)
    assert float(accuracy) > 0.93, done.stdout  # "about 0.96"
    assert (tmp_path / "history.png").stat().st_size > 0
    # what the README says a saved model's weights.pt is: a state dict plain torch loads
    state = torch.load(tmp_path / "out/digits-model/weights.pt", weights_only=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model.load_state_dict(state)
    assert sorted(p.name for p in (tmp_path / "out/digits-model").iterdir()) == [
        "metadata",
        "model_fn.cloudpickle",
        "weights.pt",
    ]
