"""A picture of a fit: loss and throughput per epoch, for the job and for each worker."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def history_series(history: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """The numbers :func:`plot_history` draws, by name (one entry per epoch)."""
    workers = len(history[0].get("worker_samples", [])) if history else 0
    return {
        "epoch": [h["epoch"] for h in history],
        "loss": [h["loss"] for h in history],
        "samples_per_s": [h["samples_per_s"] for h in history],
        "worker_samples_per_s": [
            [
                h["worker_samples"][r] / h["worker_seconds"][r] if h["worker_seconds"][r] > 0 else 0.0
                for h in history
            ]
            for r in range(workers)
        ],
    }


def plot_history(history: Sequence[dict[str, Any]], path: str | Path, title: str = "sparkdl fit") -> Path:
    """Write a PNG with two panels: the loss per epoch, and samples/s per epoch for the
    whole job and for each worker (a slow worker shows up as the low line).

    Raises:
        ValueError: ``history`` is empty (nothing was trained).
    """
    if not history:
        raise ValueError("the history is empty: fit trained no epoch, so there is nothing to plot")
    # A bare Figure renders with Agg on savefig: no pyplot, no global backend switched
    # (a notebook keeps its inline one).
    from matplotlib.figure import Figure

    series = history_series(history)
    epochs = series["epoch"]
    figure = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    loss_axes, speed_axes = figure.subplots(1, 2)
    loss_axes.plot(epochs, series["loss"], marker="o")
    loss_axes.set(title="training loss", xlabel="epoch", ylabel="mean loss over all rows")
    speed_axes.plot(epochs, series["samples_per_s"], marker="o", linewidth=2, label="all workers")
    for rank, values in enumerate(series["worker_samples_per_s"]):
        speed_axes.plot(epochs, values, linestyle="--", marker=".", label=f"rank {rank}")
    speed_axes.set(title="throughput", xlabel="epoch", ylabel="samples/s")
    speed_axes.legend(loc="best", fontsize="small")
    for axes in (loss_axes, speed_axes):
        axes.set_xticks(epochs)
        axes.grid(alpha=0.3)
    figure.suptitle(title)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, format="png")
    return target
