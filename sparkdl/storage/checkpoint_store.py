"""Atomic checkpoints of a training run, and finding the one to resume from.

A checkpoint is one ``torch.save`` file of tensors and plain values (no pickled
objects), written to a temporary name, flushed to disk, then renamed: a crash while
writing leaves the previous checkpoint untouched and loadable. Loading uses
``torch.load(weights_only=True)``, so a file carrying pickled code is refused.

Rank 0 also keeps a tiny ``progress`` file with the last step it finished and when,
so a resumed run can report how many steps it redid and how long recovery took.
"""

from __future__ import annotations

import io
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sparkdl.errors import CheckpointError

log = logging.getLogger(__name__)

KEEP = 2


@dataclass(frozen=True)
class Progress:
    step: int
    wall_time: float


class CheckpointStore:
    """The checkpoints of one run in ``directory`` (shared by all workers and attempts).

    ``name`` prefixes the files: the workers' checkpoints are ``checkpoint-<step>.pt``,
    a parameter-server shard's snapshots ``ps-shard-NNN-<step>.pt`` beside them.
    """

    def __init__(self, directory: str, name: str = "checkpoint") -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._pattern = re.compile(rf"^{re.escape(name)}-(\d{{9}})\.pt$")
        self._progress_fd: int | None = None

    def path_for(self, global_step: int) -> Path:
        return self.directory / f"{self.name}-{global_step:09d}.pt"

    def save(self, global_step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` atomically as the checkpoint of ``global_step``; keep the newest two."""
        final = self.path_for(global_step)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        buffer = io.BytesIO()
        torch.save(state, buffer)
        try:
            with open(tmp, "wb") as fh:
                fh.write(buffer.getbuffer())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"could not write checkpoint {final}: {exc}; check checkpoint_dir") from exc
        for old in self.steps()[:-KEEP]:
            self.path_for(old).unlink(missing_ok=True)
        return final

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints present, oldest first (temporary files ignored)."""
        found = (self._pattern.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def load(self, global_step: int) -> dict[str, Any]:
        """Load a checkpoint with ``weights_only=True``.

        Raises:
            CheckpointError: the file is not a checkpoint sparkdl wrote (tampered,
                truncated, or carrying pickled objects).
        """
        path = self.path_for(global_step)
        try:
            state = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as exc:
            raise CheckpointError(
                f"refused checkpoint {path}: {type(exc).__name__}: {str(exc)[:300]}. It was not written "
                "by sparkdl or was altered; delete it to resume from the previous one, or start afresh "
                "with a new checkpoint_dir"
            ) from exc
        if not isinstance(state, dict) or state.get("format") != 1:
            raise CheckpointError(
                f"refused checkpoint {path}: not a sparkdl checkpoint (format field missing)"
            )
        return state

    def record_progress(self, global_step: int) -> None:
        """Overwrite the progress file in place: cheap enough to call every step."""
        if self._progress_fd is None:
            self._progress_fd = os.open(self.directory / "progress", os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._progress_fd, f"{global_step:012d} {time.time():.6f}\n".encode(), 0)

    def progress(self) -> Progress | None:
        try:
            text = (self.directory / "progress").read_text().split()
            return Progress(int(text[0]), float(text[1]))
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        if self._progress_fd is not None:
            os.close(self._progress_fd)
            self._progress_fd = None
