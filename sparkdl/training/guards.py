"""Guards around each training step: non-finite losses, and fault drills.

Pure torch; the training loop calls these, so the rules are tested without Spark.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from sparkdl.config import OnError
from sparkdl.errors import PeerStopped, SparkDLError, TrainingFailedError, agreed

_HANG_LIMIT_S = 900.0  # a drilled hang still ends by itself


@dataclass(frozen=True)
class FaultDrill:
    """A fault injected on purpose: ``kind:rank:step:marker``.

    ``raise`` raises an exception before the step; ``exit`` kills the worker process
    in the middle of backward, while gradient all-reduces are in flight; ``hang``
    stops responding; ``killjvm`` kills the executor JVM that runs this task (only
    where executors are separate JVMs: local-cluster or a real cluster). The drill
    fires once: it creates ``marker`` first, and does not fire while ``marker`` exists
    (an empty marker fires on every attempt).
    """

    kind: str
    rank: int
    step: int
    marker: str

    @classmethod
    def parse(cls, text: str) -> FaultDrill | None:
        if not text:
            return None
        kind, rank, step, marker = text.split(":", 3)
        return cls(kind, int(rank), int(step), marker)

    def maybe_fire(self, rank: int, global_step: int, module: nn.Module) -> None:
        if rank != self.rank or global_step != self.step:
            return
        if self.marker:
            if Path(self.marker).exists():
                return
            Path(self.marker).write_text(f"rank {rank} step {global_step} pid {os.getpid()}\n")
        if self.kind == "raise":
            raise RuntimeError(f"fault drill: rank {rank} raised at step {global_step}")
        if self.kind == "exit":
            first = next(module.parameters())  # its gradient comes last: other buckets are in flight
            first.register_hook(lambda grad: os._exit(17))
        elif self.kind == "killjvm":
            os.kill(_executor_jvm_pid(), signal.SIGKILL)
            time.sleep(_HANG_LIMIT_S)  # the JVM's death takes this process down with it
        elif self.kind == "hang":
            deadline = time.monotonic() + _HANG_LIMIT_S
            while time.monotonic() < deadline:
                time.sleep(0.1)


def _executor_jvm_pid() -> int:
    """The pid of the executor JVM above this Python worker (parent chain via /proc)."""
    pid = os.getppid()
    for _ in range(8):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"CoarseGrainedExecutorBackend" in cmdline:
            return pid
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            break
    raise RuntimeError(
        "fault drill 'killjvm' needs executors in their own JVMs (local-cluster or a cluster); "
        "in local mode the executor is the driver"
    )


class NanGuard:
    """Decides what a step with a non-finite loss or gradient does; never lets it reach
    the weights (the optimizer step is what is skipped).

    All-reduce (``shares_gradients``): every rank holds the same averaged gradient, so
    a non-finite gradient is seen by all ranks at the same step and they stop together
    with no further message; the rank whose own loss was non-finite names itself.

    Local-step strategies (weight averaging, parameter server): a rank's step touches
    only its own weights or push, so a non-finite step is skipped there and counted.
    An error is not raised at once: the rank keeps skipping its steps and the strategy
    raises it on every rank together at its next sync point (the next average; the
    server's next answer), with no per-step message that would hold the ranks in
    lockstep. ``failure`` holds that pending error.
    """

    def __init__(self, policy: OnError, max_skips: int, rank: int, shares_gradients: bool = True) -> None:
        self.policy = policy
        self.max_skips = max_skips
        self.rank = rank
        self.shares_gradients = shares_gradients
        self.skipped = 0
        self.failure: SparkDLError | None = None
        self._in_a_row = 0

    def allows_step(self, loss: torch.Tensor, module: nn.Module, epoch: int, global_step: int) -> bool:
        if self.failure is not None:
            return False  # stopping: skip until the strategy raises at its sync point
        loss_finite, grads_finite = _finite(loss, module)
        if loss_finite and grads_finite:
            self._in_a_row = 0
            return True
        where = f"epoch {epoch}, step {global_step}"
        if loss_finite:  # with all-reduce: another rank's gradient made the average non-finite
            error: SparkDLError = PeerStopped(
                f"non-finite averaged gradient at {where}; rank {self.rank}'s own loss was finite"
            )
        else:
            error = TrainingFailedError(
                f"non-finite loss or gradient at rank {self.rank}, {where} (loss "
                f"{float(loss.detach()):.4g}); the step was not applied. Lower the learning rate, "
                "check the inputs, or set on_nan_loss = 'skip'",
                {self.rank: "non-finite loss"},
            )
        if self.policy is OnError.SKIP:
            self.skipped += 1
            self._in_a_row += 1
            if self._in_a_row <= self.max_skips:
                return False
            error = TrainingFailedError(
                f"{self._in_a_row} steps in a row had a non-finite loss or gradient on rank "
                f"{self.rank} (last at {where}); stopping after max_nan_skips = {self.max_skips}",
                {self.rank: "non-finite loss"},
            )
        if not self.shares_gradients:
            self.failure = error
            return False
        raise agreed(error) if not grads_finite else error


def _finite(loss: torch.Tensor, module: nn.Module) -> tuple[bool, bool]:
    """Whether the loss, and all gradients, are finite: one device sync per step."""
    grads = [p.grad.detach().float().sum() for p in module.parameters() if p.grad is not None]
    grad_total = torch.stack(grads).sum() if grads else torch.zeros((), device=loss.device)
    flags = torch.stack([torch.isfinite(loss.detach()).all(), torch.isfinite(grad_total)])
    loss_finite, grads_finite = flags.tolist()
    return bool(loss_finite), bool(grads_finite)
