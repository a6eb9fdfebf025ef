"""What the driver shows while ``fit`` runs: one progress bar per epoch, fed by reports.

Pure: no sockets. Each worker reports its own figures for the running epoch (steps
done, rows, loss sum, seconds since the epoch began); the board adds them up across
workers, so the bar shows the loss over every row trained so far in the epoch, the
samples/s of the whole job and the epoch's seconds as the workers measured them (not when
their reports happened to reach the driver). Bars come from ``tqdm.auto``: a text bar in a
terminal, a widget in Jupyter or Databricks when ipywidgets is installed. Where nothing
redraws a line (a log file, spark-submit's captured output, CI), each epoch is one line,
written when it ends. Around the epochs the board says what is happening: the stage
submitted, every worker started, and one summary line at the end.
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
    loss_sum: float  # NaN: no loss reported (a user's loop that never calls ctx.report(loss=...))
    seconds: float  # since the epoch began on this worker
    val_loss: float | None = None  # the epoch's validation loss, in its last report


#: How long after a stage's submission with no worker started the board says why it may wait.
WAIT_NOTE_S = 15.0


def announce(text: str) -> None:
    """One line of what the run is doing, below any bar (a bar in a terminal stays whole)."""
    line = f"sparkdl: {text}"
    if _redraws():
        tqdm.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)


def seconds_text(seconds: float) -> str:
    """``12.3s`` under a minute, then tqdm's ``mm:ss`` / ``h:mm:ss``."""
    return f"{seconds:.1f}s" if seconds < 60 else tqdm.format_interval(seconds)


class ProgressBoard:
    """Aggregates reports per epoch and draws them.

    Args:
        num_workers: ranks that report.
        epochs: epochs in the fit (for the bar's title).
        show: draw bars and say what happens; when False the board only keeps the figures.
        bar_factory: ``title -> bar`` with ``show(steps, total or None, figures text)`` and
            ``close()`` (by default a tqdm bar where a line is redrawn, else one line an epoch).
        clock: monotonic clock of the times announced (patched in tests).
    """

    def __init__(
        self,
        num_workers: int,
        epochs: int,
        show: bool = True,
        bar_factory: Any = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.num_workers = num_workers
        self.epochs = epochs
        self.show = show
        self._bar_factory = bar_factory or (_TerminalBar if _redraws() else _LineBar)
        self._clock = clock
        self._lock = threading.Lock()
        self._reports: dict[int, dict[int, Report]] = {}  # epoch -> rank -> latest
        self._bar: Any = None
        self._bar_epoch = 0
        self._submitted: float | None = None  # when the stage was submitted (clock)
        self._started: dict[int, set[int]] = {}  # stage attempt -> ranks that connected
        self._waiting: threading.Timer | None = None
        self._succeeded = self._closed = False

    def stage_submitted(self, what: str, note_wait_s: float = WAIT_NOTE_S) -> None:
        """The stage's tasks were handed to Spark: say so (executors start Python and import
        torch before any worker can report), and again if no worker started ``note_wait_s``
        later (a barrier stage starts only when all its tasks have slots at once: another
        fit's stage may hold them)."""
        with self._lock:
            self._submitted = self._clock()
            if self.show:
                announce(what)
                self._waiting = threading.Timer(note_wait_s, self._note_waiting, args=(note_wait_s,))
                self._waiting.daemon = True
                self._waiting.start()

    def _note_waiting(self, waited_s: float) -> None:
        with self._lock:
            if not any(self._started.values()) and self._waiting is not None:
                announce(
                    f"no worker started yet, {waited_s:.0f}s after the stage was submitted: its "
                    f"{self.num_workers} tasks wait for {self.num_workers} free task slots at once (another "
                    "stage, e.g. a fit beside this one, may hold them) or for executors to start"
                )

    def worker_started(self, rank: int, attempt: int) -> None:
        """Rank ``rank`` of stage attempt ``attempt`` connected: once every rank of an attempt
        did, say how long the start took and what comes before the first step."""
        with self._lock:
            started = self._started.setdefault(attempt, set())
            if rank in started:
                return
            started.add(rank)
            if len(started) == self.num_workers and self.show:
                since = self._since_submitted()
                again = " again (Spark re-ran the stage)" if len(self._started) > 1 else ""
                who = "the worker" if self.num_workers == 1 else f"all {self.num_workers} workers"
                announce(f"{who} started{again}{since}; building the model and checking the first batch")

    def finish(self) -> None:
        """The stage succeeded: its summary line is written at :meth:`close`, once the
        channel has read what the workers sent last (their final reports may still be on
        their way when the stage's result is back)."""
        with self._lock:
            self._succeeded = True
            self._stop_waiting()

    def _summary(self) -> None:
        """One line for the whole run (lock held)."""
        epochs = sorted(self._reports)
        figures = [self._figures(self._reports[e]) for e in epochs]
        last = figures[-1]
        trained = sum(f["seconds"] for f in figures)
        samples = sum(f["samples"] for f in figures)
        steps = sum(f["steps"] for f in figures)
        parts = [f"{len(epochs)} epoch{'s' if len(epochs) > 1 else ''} trained in {seconds_text(trained)}"]
        parts.append(f"{steps:,.0f} steps, {samples:,.0f} samples")
        if math.isfinite(last["loss"]):
            parts.append(f"last epoch's loss {last['loss']:.4f}")
        if math.isfinite(last["val_loss"]):
            parts.append(f"val_loss {last['val_loss']:.4f}")
        announce(", ".join(parts) + self._since_submitted())

    def _since_submitted(self) -> str:
        if self._submitted is None:
            return ""
        return f", {seconds_text(self._clock() - self._submitted)} after the stage was submitted"

    def update(self, report: Report) -> None:
        with self._lock:
            by_rank = self._reports.setdefault(report.epoch, {})
            previous = by_rank.get(report.rank)
            if previous is not None and previous.attempt > report.attempt:
                return  # a late frame of a failed attempt
            by_rank[report.rank] = report
            if self.show and not self._closed and report.epoch >= self._bar_epoch:
                self._draw(report.epoch)

    def epoch_figures(self, epoch: int) -> dict[str, float]:
        """Loss, samples, samples/s and steps of ``epoch`` so far, across workers."""
        with self._lock:
            return self._figures(self._reports.get(epoch, {}))

    def close(self) -> None:
        """The channel is closed: close the last bar and, after :meth:`finish`, write the
        run's summary line; nothing is drawn after."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._close_bar()
            self._stop_waiting()
            if self._succeeded and self.show and self._reports:
                self._summary()

    def _stop_waiting(self) -> None:
        if self._waiting is not None:
            self._waiting.cancel()
            self._waiting = None

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _figures(self, by_rank: dict[int, Report]) -> dict[str, float]:
        samples = sum(r.samples for r in by_rank.values())
        # each worker's own rate, summed: its reports arrive at other moments than its peers'
        rate = sum(r.samples / r.seconds for r in by_rank.values() if r.seconds > 0)
        # the loss over the rows of the workers that reported one (a worker whose loop reports
        # none, or that sat the epoch out, sends NaN); NaN where none did: nothing to show
        losses = [r for r in by_rank.values() if math.isfinite(r.loss_sum)]
        loss_rows = sum(r.samples for r in losses)
        return {
            "loss": sum(r.loss_sum for r in losses) / loss_rows if loss_rows else math.nan,
            "samples": float(samples),
            "samples_per_s": rate,
            "steps": float(min((r.steps for r in by_rank.values()), default=0)),
            "total_steps": float(max((r.total_steps for r in by_rank.values()), default=-1)),
            # every rank reports the same all-reduced value: any finite one is the epoch's
            "val_loss": next((r.val_loss for r in by_rank.values() if r.val_loss is not None), math.nan),
            # the epoch's seconds as the slowest worker measured them
            "seconds": max((r.seconds for r in by_rank.values()), default=0.0),
        }

    def _draw(self, epoch: int) -> None:
        if epoch != self._bar_epoch:
            self._close_bar()
            self._bar = self._bar_factory(f"epoch {epoch}/{self.epochs}")
            self._bar_epoch = epoch
        figures = self._figures(self._reports[epoch])
        steps, total, seconds = int(figures["steps"]), int(figures["total_steps"]), figures["seconds"]
        time_text = seconds_text(seconds)
        if total > 0 and 0 < steps < total:  # what is left, at the epoch's pace so far
            time_text += f"<{seconds_text(seconds / steps * (total - steps))}"
        shown = [time_text]
        if math.isfinite(figures["loss"]):
            shown.append(f"loss={figures['loss']:.4f}")
        shown.append(f"samples_s={figures['samples_per_s']:,.0f}")
        if math.isfinite(figures["val_loss"]):
            shown.append(f"val_loss={figures['val_loss']:.4f}")
        self._bar.show(steps, total if total > 0 else None, ", ".join(shown))


_UNKNOWN_LENGTH = "{desc}: step {n_fmt} [{figures}]"
_KNOWN_LENGTH = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps [{figures}]"


class _FiguresBar(tqdm):
    """tqdm with the board's figures in its line: tqdm's own elapsed time and rate would be
    wrong here (steps arrive in jumps, every ``progress_interval_s``, and the bar opens at the
    driver's first report, not when the epoch began)."""

    figures = "starting"

    @property
    def format_dict(self) -> dict[str, Any]:
        values = dict(super().format_dict)
        values["figures"] = self.figures
        return values


class _TerminalBar:
    """A bar redrawn in place: a terminal's line, or a notebook's widget."""

    def __init__(self, title: str) -> None:
        self._bar = _FiguresBar(
            total=None, desc=title, unit="step", dynamic_ncols=True, leave=True, bar_format=_UNKNOWN_LENGTH
        )

    def show(self, steps: int, total: int | None, figures: str) -> None:
        if total is not None and self._bar.total != total:
            self._bar.total = total
            self._bar.bar_format = _KNOWN_LENGTH
        self._bar.n = steps
        self._bar.figures = figures
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def _redraws() -> bool:
    """Whether a bar can be redrawn in place: a terminal, or a notebook's widget."""
    if bool(getattr(sys.stderr, "isatty", lambda: False)()):
        return True
    ipython = sys.modules.get("IPython")  # a kernel running this process: as tqdm.auto decides
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class _LineBar:
    """A bar for output nothing redraws: one line per epoch, when it closes, with what the
    bar last showed."""

    def __init__(self, title: str) -> None:
        self.title = title
        self._steps, self._figures = 0, ""
        self._total: int | None = None

    def show(self, steps: int, total: int | None, figures: str) -> None:
        self._steps, self._total, self._figures = steps, total, figures

    def close(self) -> None:
        steps = f"{self._steps}/{self._total} steps" if self._total else f"{self._steps} steps"
        print(f"{self.title}: {steps}, {self._figures}", file=sys.stderr, flush=True)
