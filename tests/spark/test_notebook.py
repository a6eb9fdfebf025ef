"""examples/quickstart.ipynb runs top to bottom in a real Jupyter kernel."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def test_the_quickstart_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    notebook = nbformat.read(ROOT / "examples/quickstart.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    outputs = {
        i: "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "code"
    }
    text = "\n".join(outputs.values())
    assert "held-out accuracy: 0.9" in text
    assert "{'strategy': 'weight_averaging', 'sync_every': 8} accuracy" in text
    assert "{'strategy': 'parameter_server', 'ps_mode': 'async'} accuracy" in text
    images = [o for c in notebook.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images  # the history plot rendered inline
    assert not (tmp_path / "history.png").exists()  # nothing left where the notebook runs
