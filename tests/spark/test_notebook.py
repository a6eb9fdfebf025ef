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


def test_python_m_sparkdl_notebook_prints_what_the_cells_print_and_fails_with_a_failing_cell(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    import subprocess
    import sys

    def notebook(*sources: str) -> str:
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        path = tmp_path / f"nb{len(list(tmp_path.iterdir()))}.ipynb"
        nbformat.write(nb, path)
        return str(path)

    def run(path: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sparkdl", "notebook", path, "--timeout", "120"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )

    good = notebook("x = 6 * 7", "print('held-out accuracy:', x)")
    done = run(good)
    assert (done.returncode, done.stdout) == (0, "held-out accuracy: 42\n")
    bad = run(notebook("print('before')", "raise ValueError('cell two broke')"))
    assert bad.returncode == 1 and bad.stdout == "before\n" and "cell two broke" in bad.stderr
