"""model.plot_history: the numbers drawn, and a real PNG on disk."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from sparkdl.ml.plots import history_series, plot_history

HISTORY = [
    {
        "epoch": 1,
        "loss": 2.0,
        "samples_per_s": 900.0,
        "worker_samples": [600, 300],
        "worker_seconds": [1.0, 1.0],
    },
    {
        "epoch": 2,
        "loss": 1.0,
        "samples_per_s": 1800.0,
        "worker_samples": [600, 300],
        "worker_seconds": [0.5, 0.5],
    },
]


def test_the_series_are_the_job_and_each_worker_per_epoch():
    series = history_series(HISTORY)
    assert series["epoch"] == [1, 2]
    assert series["loss"] == [2.0, 1.0]
    assert series["samples_per_s"] == [900.0, 1800.0]
    assert series["worker_samples_per_s"] == [[600.0, 1200.0], [300.0, 600.0]]  # rank 1 is the slow one


def test_a_png_is_written_with_both_panels(tmp_path):
    path = plot_history(HISTORY, tmp_path / "plots/history.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = plt.imread(path)
    assert image.shape[:2] == (400, 1000)
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_an_empty_history_says_why():
    with pytest.raises(ValueError, match="fit trained no epoch"):
        plot_history([], "unused.png")
