"""The process a :class:`sparkdl.TorchDistributor` launches for a function:
``python -m sparkdl.worker.child DIR``.

``DIR/function.pkl`` holds ``(function, args, kwargs)``, cloudpickled on the driver. The
child calls it with torchrun's environment already set (by the agent that launched it),
and leaves in ``DIR``:

- rank 0's return value: ``output.pt`` when it is a dict of tensors (a state dict: loaded
  with ``weights_only=True`` and sent to the driver without the JVM or pickle), else
  ``output.pkl`` (cloudpickle, as PySpark's distributor returns it);
- on an exception, ``error.json``: its type, message and traceback, for the driver's
  error (the traceback also goes to stderr, as an uncaught exception's would).

Files are written to a temporary name and renamed, so the agent never reads half of one.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

from sparkdl.worker.returned import cpu_state, is_state_dict

FUNCTION_FILE = "function.pkl"
TENSORS_FILE = "output.pt"
PICKLE_FILE = "output.pkl"
ERROR_FILE = "error.json"

__all__ = ["ERROR_FILE", "FUNCTION_FILE", "PICKLE_FILE", "TENSORS_FILE", "main", "save_error", "save_output"]


def _write(directory: str, name: str, write: Any) -> None:
    partial = os.path.join(directory, f".{name}.partial")
    with open(partial, "wb") as out:
        write(out)
    os.replace(partial, os.path.join(directory, name))


def save_output(directory: str, value: Any) -> None:
    """Rank 0's return value, in the form the agent sends on."""
    if is_state_dict(value):
        import torch

        state = cpu_state(value)
        _write(directory, TENSORS_FILE, lambda out: torch.save(state, out))
    else:
        import cloudpickle

        _write(directory, PICKLE_FILE, lambda out: cloudpickle.dump(value, out))


def save_error(directory: str, error: BaseException) -> None:
    record = {
        "python_type": type(error).__qualname__,
        "message": str(error),
        "traceback": "".join(traceback.format_exception(error))[-8000:],
    }
    _write(directory, ERROR_FILE, lambda out: out.write(json.dumps(record).encode()))


def claim_failure() -> None:
    """Claim the run's failure in the agents' store (``MASTER_ADDR:MASTER_PORT``) unless a
    rank did first: the others' errors, which follow this process's exit, are then known as
    echoes. Best effort, bounded: the agent claims it too when it sees this process exit."""
    try:
        from datetime import timedelta

        import torch.distributed as dist

        from sparkdl.worker.launcher import FAILED_KEY

        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            None,
            is_master=False,
            timeout=timedelta(seconds=5),
        )
        store.compare_set(FAILED_KEY, "", os.environ["RANK"])
    except Exception:
        pass


def main(directory: str) -> int:
    import cloudpickle

    with open(os.path.join(directory, FUNCTION_FILE), "rb") as source:
        function, args, kwargs = cloudpickle.load(source)
    try:
        value = function(*args, **kwargs)
    except BaseException as exc:  # the user's code: reported whatever it raised (SystemExit too)
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            value = None
        else:
            claim_failure()  # first: before this process's sockets close and fail the others
            traceback.print_exc()
            save_error(directory, exc)
            return exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    if os.environ.get("RANK") == "0":
        save_output(directory, value)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
