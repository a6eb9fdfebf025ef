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
import torch.distributed as dist
from torch import nn

from sparkdl.config import OnError
from sparkdl.errors import TrainingFailedError

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
    """Decides what a step with a non-finite loss or gradient does, the same on every rank.

    With all-reduce the gradients are already averaged, so one rank's NaN is every
    rank's NaN and all ranks decide alike without another message. Strategies that
    step on local gradients (weight averaging, parameter server) set ``agree``: one
    all-reduce of a flag per rank per step then tells every rank which ranks saw a
    non-finite value, so they skip the same step, or stop together (the stage then
    ends without a task failure Spark would retry). Either way the optimizer step is
    what is skipped, so nothing non-finite ever reaches the weights.
    """

    def __init__(
        self,
        policy: OnError,
        max_skips: int,
        rank: int,
        agree: bool = False,
        group: dist.ProcessGroup | None = None,  # None: the default group
    ) -> None:
        self.policy = policy
        self.max_skips = max_skips
        self.rank = rank
        self.agree = agree
        self.group = group
        self.skipped = 0
        self._in_a_row = 0

    def allows_step(
        self, loss: torch.Tensor | None, module: nn.Module | None, epoch: int, global_step: int
    ) -> bool:
        """Whether the step may be applied; ``loss`` None: this rank had no data this step."""
        finite = loss is None or module is None or _all_finite(loss, module)
        bad_ranks = [] if finite else [self.rank]
        if self.agree:
            flags = torch.zeros(dist.get_world_size(self.group))
            flags[self.rank] = 0.0 if finite else 1.0
            dist.all_reduce(flags, group=self.group)
            bad_ranks = [r for r, flag in enumerate(flags.tolist()) if flag]
        if not bad_ranks:
            self._in_a_row = 0
            return True
        ranks = f"rank {bad_ranks[0]}" if len(bad_ranks) == 1 else f"ranks {bad_ranks}"
        where = f"{ranks}, epoch {epoch}, step {global_step}"
        value = f" (loss {float(loss.detach()):.4g})" if loss is not None and not finite else ""
        if self.policy is OnError.ERROR:
            self._stop(
                f"non-finite loss or gradient at {where}{value}; the step was not applied. Lower "
                "the learning rate, check the inputs, or set on_nan_loss = 'skip'"
            )
        self.skipped += 1
        self._in_a_row += 1
        if self._in_a_row > self.max_skips:
            self._stop(
                f"{self._in_a_row} steps in a row had a non-finite loss or gradient (last at {where}); "
                f"stopping after max_nan_skips = {self.max_skips}"
            )
        return False

    def _stop(self, message: str) -> None:
        error = TrainingFailedError(message, {self.rank: "non-finite loss"})
        # with the flag all-reduce every rank raises this at the same step
        error.agreed_by_all_ranks = self.agree  # type: ignore[attr-defined]
        raise error


def _all_finite(loss: torch.Tensor, module: nn.Module) -> bool:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    total = loss.detach().float().sum() + sum(
        (g.float().sum() for g in grads), torch.zeros((), device=loss.device)
    )
    return bool(torch.isfinite(total))
