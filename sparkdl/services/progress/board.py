"""What the driver shows while ``fit`` runs: one progress bar per epoch, fed by reports.

Pure: no sockets. Each worker reports its own figures for the running epoch (steps
done, rows, loss sum, seconds); the board adds them up across workers, so the bar
shows the loss over every row trained so far in the epoch and the samples/s of the
whole job. Bars come from ``tqdm.auto``: a text bar in a terminal, a widget in
Jupyter or Databricks when ipywidgets is installed. Where nothing redraws a line (a log
file, spark-submit's captured output, CI), each epoch is one line, written when it ends.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm


@dataclass(frozen=True)
class Report:
    """One worker's figures for the epoch so far."""

    rank: int
    epoch: int
    attempt: int  # the stage attempt: a re-run stage's reports replace the failed one's
    steps: int
    total_steps: int  # -1 while unknown (epoch 1 streams from Spark)
    samples: int
    loss_sum: float
    seconds: float
    val_loss: float | None = None  # the epoch's validation loss, in its last report


class ProgressBoard:
    """Aggregates reports per epoch and draws them.

    Args:
        num_workers: ranks that report.
        epochs: epochs in the fit (for the bar's title).
        show: draw bars; when False the board only keeps the figures.
        bar_factory: builds a bar (``tqdm`` by default; tests pass their own).
    """

    def __init__(self, num_workers: int, epochs: int, show: bool = True, bar_factory: Any = None) -> None:
        self.num_workers = num_workers
        self.epochs = epochs
        self.show = show
        self._bar_factory = bar_factory or (_tqdm_bar if _redraws() else _LineBar)
        self._lock = threading.Lock()
        self._reports: dict[int, dict[int, Report]] = {}  # epoch -> rank -> latest
        self._bar: Any = None
        self._bar_epoch = 0

    def update(self, report: Report) -> None:
        with self._lock:
            by_rank = self._reports.setdefault(report.epoch, {})
            previous = by_rank.get(report.rank)
            if previous is not None and previous.attempt > report.attempt:
                return  # a late frame of a failed attempt
            by_rank[report.rank] = report
            if self.show and report.epoch >= self._bar_epoch:
                self._draw(report.epoch)

    def epoch_figures(self, epoch: int) -> dict[str, float]:
        """Loss, samples, samples/s and steps of ``epoch`` so far, across workers."""
        with self._lock:
            return self._figures(self._reports.get(epoch, {}))

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def _figures(self, by_rank: dict[int, Report]) -> dict[str, float]:
        samples = sum(r.samples for r in by_rank.values())
        # each worker's own rate, summed: its reports arrive at other moments than its peers'
        rate = sum(r.samples / r.seconds for r in by_rank.values() if r.seconds > 0)
        return {
            "loss": sum(r.loss_sum for r in by_rank.values()) / samples if samples else float("nan"),
            "samples": float(samples),
            "samples_per_s": rate,
            "steps": float(min((r.steps for r in by_rank.values()), default=0)),
            "total_steps": float(max((r.total_steps for r in by_rank.values()), default=-1)),
            # every rank reports the same all-reduced value: any finite one is the epoch's
            "val_loss": next((r.val_loss for r in by_rank.values() if r.val_loss is not None), math.nan),
        }

    def _draw(self, epoch: int) -> None:
        if epoch != self._bar_epoch:
            if self._bar is not None:
                self._bar.close()
            self._bar = self._bar_factory(f"epoch {epoch}/{self.epochs}")
            self._bar_epoch = epoch
        figures = self._figures(self._reports[epoch])
        total = int(figures["total_steps"])
        if total > 0 and self._bar.total != total:
            self._bar.total = total
            self._bar.bar_format = _KNOWN_LENGTH
        self._bar.n = int(figures["steps"])
        postfix = {"loss": f"{figures['loss']:.4f}", "samples_s": f"{figures['samples_per_s']:,.0f}"}
        if math.isfinite(figures["val_loss"]):
            postfix["val_loss"] = f"{figures['val_loss']:.4f}"
        self._bar.set_postfix(refresh=False, **postfix)
        self._bar.refresh()


# tqdm's own rate would be wrong here (steps arrive in jumps, every interval_s): the
# bars show the workers' samples/s from the postfix instead.
_UNKNOWN_LENGTH = "{desc}: step {n_fmt} [{elapsed}{postfix}]"
_KNOWN_LENGTH = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps [{elapsed}<{remaining}{postfix}]"


def _tqdm_bar(title: str) -> Any:
    return tqdm(
        total=None, desc=title, unit="step", dynamic_ncols=True, leave=True, bar_format=_UNKNOWN_LENGTH
    )


def _redraws() -> bool:
    """Whether a bar can be redrawn in place: a terminal, or a notebook's widget."""
    if bool(getattr(sys.stderr, "isatty", lambda: False)()):
        return True
    ipython = sys.modules.get("IPython")  # a kernel running this process: as tqdm.auto decides
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class _LineBar:
    """A bar for output nothing redraws: one line per epoch, when it closes, with the
    figures the bar last showed (the attributes are tqdm's, as :class:`ProgressBoard` sets them)."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.total: int | None = None
        self.bar_format = _UNKNOWN_LENGTH
        self.n = 0
        self._postfix: dict[str, str] = {}
        self._started = time.monotonic()

    def set_postfix(self, refresh: bool = True, **postfix: str) -> None:
        self._postfix = postfix

    def refresh(self) -> None:
        """Nothing: the line is written once, at :meth:`close`."""

    def close(self) -> None:
        steps = f"{self.n}/{self.total} steps" if self.total else f"{self.n} steps"
        figures = "".join(f", {name}={value}" for name, value in self._postfix.items())
        print(f"{self.title}: {steps}, {time.monotonic() - self._started:.1f}s{figures}", file=sys.stderr)
