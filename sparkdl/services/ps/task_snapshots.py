"""The driver's snapshots of an independent-task server (``ps_barrier = false``).

Independent tasks checkpoint nothing: a retried task resumes from the server's weights and
its partition's rows. What the driver itself could lose (the application dying: the driver
host, a killed job) is the server: its weights, optimizer state, version and the rows each
partition's pushes put in the weights. :class:`TaskSnapshots` writes them to
``reliability.checkpoint_dir`` as ``ps-tasks-<version>.pt`` (locally renamed into place, on an
object store behind a manifest, the newest two kept: :class:`~sparkdl.storage.checkpoint_store.
CheckpointStore`) every ``every_versions`` updates and once more when the fit ends, failed or
not; a new fit on the same directory restores the newest before its tasks start, and each
task skips the rows of its partition already in the weights, as a retry does.

Pure: torch and the checkpoint store only; the fit's driver runs :meth:`TaskSnapshots.watch`
on a thread of its own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from sparkdl.errors import CheckpointError, PushRejected
from sparkdl.services.ps.store import ShardStore
from sparkdl.storage.checkpoint_store import CheckpointStore

log = logging.getLogger(__name__)

#: The files' prefix beside the workers' checkpoints.
NAME = "ps-tasks"


class TaskSnapshots:
    """Snapshots of ``store`` (an independent one) in ``directory``, one every
    ``every_versions`` updates (0: only at the end).

    Raises:
        CheckpointError: the directory cannot be opened (object store access refused).
        ConfigError: its scheme has no filesystem installed.
    """

    def __init__(
        self,
        store: ShardStore,
        directory: str,
        options: Mapping[str, str] | None = None,
        every_versions: int = 0,
    ) -> None:
        self._store = store
        self._files = CheckpointStore(directory, name=NAME, options=options)
        self._every = every_versions
        self._saved = -1  # the version last written
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._saving = threading.Lock()  # the watcher's save and close's never run at once

    def restore(self) -> dict[str, int | list[int]] | None:
        """Return the store to the newest snapshot, if any: what was restored (its version
        and each partition's rows), None for a fresh start.

        Raises:
            CheckpointError: the snapshot cannot be read, or is of another model or number of
                partitions (the message says which, and to start afresh with a new directory).
        """
        newest = self._files.latest()
        if newest is None:
            return None
        state = self._files.load(newest)
        try:
            self._store.restore(state)
        except PushRejected as exc:
            raise CheckpointError(f"{self._files.path_for(newest)}: {exc}") from exc
        self._saved = int(state["version"])
        rows = [int(r) for r in state["rows_applied"]]
        log.info(
            "the parameter server resumes from its snapshot of version %d (rows per partition %s)",
            newest,
            rows,
        )
        return {"version": int(state["version"]), "rows_applied": rows}

    def save(self) -> int:
        """Write the store's state now, unless this version is written already; its version."""
        with self._saving:
            state = self._store.snapshot()
            version = int(state["version"])
            if version != self._saved:
                self._files.save(version, {"format": 1, **state})
                self._saved = version
            return version

    def watch(self, poll_s: float = 1.0) -> None:
        """Save every ``every_versions`` updates, on a thread, until :meth:`close`."""
        if self._every <= 0:
            return
        self._thread = threading.Thread(
            target=self._run, args=(poll_s,), name="sparkdl-ps-snapshots", daemon=True
        )
        self._thread.start()

    def _run(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            if self._store.version - max(self._saved, 0) >= self._every:
                try:
                    self.save()
                except Exception as exc:  # the next one may succeed; the fit goes on
                    log.warning("the parameter server's snapshot failed: %s", exc)

    def close(self) -> int | None:
        """Stop watching and write the last snapshot (its version; None if it failed, logged)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30.0)
        try:
            return self.save()
        except Exception as exc:  # logged: the fit's own error or result is what fit reports
            log.warning("the parameter server's last snapshot failed: %s", exc)
            return None
        finally:
            self._files.close()
