"""Checkpoints of a training run, visible only when complete, and finding the one to resume from.

A checkpoint is one ``torch.save`` file of tensors and plain values (no pickled objects).
Loading uses ``torch.load(weights_only=True)``, so a file carrying pickled code is refused.

On a local (or mounted) directory it is written to a temporary name, flushed, then renamed:
a crash while writing leaves the previous checkpoint untouched and loadable. An object store
(``s3://``, ``gs://``, ``abfss://``, through fsspec: :mod:`sparkdl.storage.filesystems`) has
no atomic rename, so there the file is written under its final name and a small manifest
``<name>-<step>.json`` after it: a checkpoint exists once its manifest does, so a reader
never sees half of one (a crash between the two leaves a file no one lists). Old ones go
manifest first. With ``background=True`` the upload runs on a thread (at most one in
flight): the caller waits only for ``torch.save`` into memory, and the next save, a load
and :meth:`CheckpointStore.close` wait for the upload before them (bounded by
``upload_timeout_s``) and raise its failure.

A strategy whose parameters are sharded over the ranks (fsdp, tensor parallelism) has each
rank write its own shards into the folder ``<name>-<step>.shards`` (:mod:`sparkdl.storage.
sharded`) before rank 0 writes the checkpoint file, which then holds the rest (where training
stands) and names that folder: the file, or its manifest, still makes the checkpoint
visible, and pruning removes the folder with it. With ``background=True`` the shards are
written on the same thread as uploads, locally too (:meth:`CheckpointStore.save_sharded`):
the step waits for their copy into host memory only.

Rank 0 also keeps a tiny ``progress`` file with the last step it finished and when, so a
resumed run can report how many steps it redid and how long recovery took. Locally it is
rewritten in place every step; on an object store (one PUT per write) at most every
:data:`PROGRESS_EVERY_S` seconds, when no upload is in flight, and at close.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sparkdl.errors import CheckpointError
from sparkdl.storage.filesystems import Location, access_error, local_path, open_url

log = logging.getLogger(__name__)

KEEP = 2
#: The most a failing worker waits for its checkpoint's upload before it reports its error.
FAILING_WAIT_S = 30.0

#: Fewest seconds between two writes of the progress file on an object store.
PROGRESS_EVERY_S = 5.0


@dataclass(frozen=True)
class Progress:
    step: int
    wall_time: float


class _Uploads:
    """At most one upload in flight, on a thread joined before the next starts and at close."""

    def __init__(self, background: bool, timeout_s: float, where: str) -> None:
        self.background, self.timeout_s, self.where = background, timeout_s, where
        self._thread: threading.Thread | None = None
        self._what = ""
        self._failure: BaseException | None = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, what: str, job: Callable[[], None]) -> None:
        """Run ``job`` (in the background, or now), after the previous one ends."""
        self.wait()
        if not self.background:
            job()
            return
        self._what = what
        self._thread = threading.Thread(
            target=self._run, args=(job,), name="sparkdl-checkpoint-upload", daemon=True
        )
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # handed to the training thread by wait()
            self._failure = exc

    def wait(self) -> None:
        """Wait for the upload in flight.

        Raises:
            CheckpointError: it failed, or ran past ``timeout_s``.
        """
        thread = self._thread
        if thread is not None:
            thread.join(self.timeout_s)
            if thread.is_alive():
                raise CheckpointError(
                    f"the upload of the {self._what} to {self.where} still runs after {self.timeout_s:g} s; "
                    "check the store's bandwidth, or raise reliability.checkpoint_upload_timeout_s"
                )
            self._thread = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def settle(self, timeout_s: float) -> None:
        """On the way out after an error: give the upload in flight up to ``timeout_s`` to
        finish (it may be the checkpoint the retry resumes from); log, never raise, what
        became of it, so that the error that ended training stays the one reported."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning(
                    "the upload of the %s to %s is left running after %g s", self._what, self.where, timeout_s
                )
                return
            self._thread = None
        failure, self._failure = self._failure, None
        if failure is not None:
            log.warning("the upload of the %s to %s failed: %s", self._what, self.where, failure)


class CheckpointStore:
    """The checkpoints of one run in ``directory`` (shared by all workers and attempts): a
    local path, or a URL opened with ``options`` (a :class:`~sparkdl.storage.filesystems.
    PathWithOptions` carries its own).

    ``name`` prefixes the files: the workers' checkpoints are ``checkpoint-<step>.pt``,
    a parameter-server shard's snapshots ``ps-shard-NNN-<step>.pt`` beside them.

    Raises:
        CheckpointError: the URL's store refused access (the credential sources tried named).
        ConfigError: its scheme has no filesystem installed.
    """

    def __init__(
        self,
        directory: str,
        name: str = "checkpoint",
        options: Mapping[str, str] | None = None,
        background: bool = False,
        upload_timeout_s: float = 600.0,
    ) -> None:
        self.name = name
        self._pattern = re.compile(rf"^{re.escape(name)}-(\d{{9}})\.(pt|json|shards)$")
        self._progress_fd: int | None = None
        self._progress_written = (0, 0.0)  # (step, wall time) last written to an object store
        self._progress: Progress | None = None
        self.options: dict[str, str] = {}  # the object store's (the shards' writers open it too)
        local = local_path(directory)
        self._remote: Location | None = None
        if local is not None:
            self.directory: Path | str = local
            local.mkdir(parents=True, exist_ok=True)
        else:
            given = options if options is not None else getattr(directory, "storage_options", {})
            self.options = dict(given)
            remote = open_url(str(directory), given, "reliability.checkpoint_dir")
            self.directory, self._remote = str(directory).rstrip("/"), remote
            try:
                remote.fs.makedirs(remote.path, exist_ok=True)
                remote.fs.find(remote.path, maxdepth=1)
            except Exception as exc:
                raise access_error(remote, "open the checkpoint directory", exc) from exc
        self.upload_timeout_s = upload_timeout_s
        self._uploads = _Uploads(background, upload_timeout_s, str(self.directory))

    def _file(self, global_step: int, kind: str = "pt") -> str:
        return f"{self.name}-{global_step:09d}.{kind}"

    def path_for(self, global_step: int, kind: str = "pt") -> Path | str:
        if isinstance(self.directory, Path):
            return self.directory / self._file(global_step, kind)
        return f"{self.directory}/{self._file(global_step, kind)}"

    def shards_for(self, global_step: int) -> Path | str:
        """The folder the ranks write their shards of ``global_step``'s checkpoint into."""
        return self.path_for(global_step, "shards")

    def retract(self, global_step: int) -> None:
        """Rank 0, before the ranks write the shards of ``global_step`` (a resumed run redoing
        it): its checkpoint stops being visible first, then its old shards go."""
        self._uploads.wait()
        if self._remote is None:
            Path(self.path_for(global_step)).unlink(missing_ok=True)
            self._remove_shards(global_step)
            return
        fs = self._remote.fs
        try:
            for name in (self._file(global_step, "json"), self._file(global_step)):
                if fs.exists(self._remote.child(name)):
                    fs.rm_file(self._remote.child(name))
            self._remove_shards(global_step)
        except Exception as exc:
            raise access_error(
                self._remote, f"remove the old checkpoint of step {global_step} from", exc
            ) from exc

    def _remove_shards(self, global_step: int) -> None:
        if self._remote is None:
            shutil.rmtree(self.shards_for(global_step), ignore_errors=True)
            return
        folder = self._remote.child(self._file(global_step, "shards"))
        if self._remote.fs.exists(folder):
            self._remote.fs.rm(folder, recursive=True)

    def save(self, global_step: int, state: dict[str, Any]) -> Path | str:
        """Write ``state`` as the checkpoint of ``global_step`` (on an object store, in the
        background when the store was made so); keep the newest two."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        if self._remote is not None:
            what = f"checkpoint of step {global_step}"
            self._uploads.submit(what, lambda: self._write(global_step, buffer))
        else:
            self._write(global_step, buffer)
        return self.path_for(global_step)

    def save_sharded(self, global_step: int, write: Callable[[], None], state: dict[str, Any] | None) -> None:
        """Every rank: ``write`` this rank's shards of ``global_step`` (a collective of the
        ranks' writes, in :meth:`shards_for`), in the background when the store was made so;
        then on rank 0 (``state`` given) the checkpoint file that makes them visible, once
        every rank's shards and DCP's metadata are in. One checkpoint in flight: the previous
        one's writes end first."""
        buffer = None
        if state is not None:
            buffer = io.BytesIO()
            torch.save(state, buffer)

        def job() -> None:
            write()
            if buffer is not None:
                self._write(global_step, buffer)

        self._uploads.submit(f"checkpoint shards of step {global_step}", job)

    def flush(self) -> None:
        """Wait for the write in flight (bounded by ``upload_timeout_s``).

        Raises:
            CheckpointError: it failed, or ran past its timeout.
        """
        self._uploads.wait()

    def _write(self, global_step: int, buffer: io.BytesIO) -> None:
        """The checkpoint file of ``global_step``: uploaded (object store) or written locally."""
        if self._remote is not None:
            self._upload(global_step, buffer)
        else:
            self._write_local(global_step, buffer)

    def _write_local(self, global_step: int, buffer: io.BytesIO) -> None:
        """The file written aside, then renamed into place; then prune."""
        final = self.path_for(global_step)
        assert isinstance(final, Path)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(buffer.getbuffer())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"could not write checkpoint {final}: {exc}; check checkpoint_dir") from exc
        kept = self.steps()
        for old in kept[:-KEEP]:
            final.with_name(self._file(old)).unlink(missing_ok=True)
            self._remove_shards(old)
        for orphan in self._unlisted(below=min(kept[-KEEP:], default=global_step)):
            self._remove_shards(orphan)

    def _upload(self, global_step: int, buffer: io.BytesIO) -> None:
        """The file under its final name, then its manifest; then prune, manifests first.

        A step written again (a resumed run redoing it) loses its old manifest before its file
        is rewritten: a reader never finds a manifest over a file being replaced. Pruning also
        removes the files older than every kept checkpoint that never got their manifest (a
        writer that died in between)."""
        remote = self._remote
        assert remote is not None
        fs, part = remote.fs, remote.child(self._file(global_step))
        listed = remote.child(self._file(global_step, "json"))
        size = buffer.getbuffer().nbytes
        manifest = {"format": 1, "step": global_step, "files": {self._file(global_step): size}}
        try:
            if fs.exists(listed):
                fs.rm_file(listed)
            with fs.open(part, "wb") as fh:
                fh.write(buffer.getbuffer())
            fs.pipe_file(listed, json.dumps(manifest).encode())
            kept = self.steps()
            for old in kept[:-KEEP]:
                fs.rm_file(remote.child(self._file(old, "json")))
                fs.rm_file(remote.child(self._file(old)))
                self._remove_shards(old)
            for orphan in self._unlisted(below=min(kept[-KEEP:], default=global_step)):
                if fs.exists(remote.child(self._file(orphan))):
                    fs.rm_file(remote.child(self._file(orphan)))
                self._remove_shards(orphan)
        except Exception as exc:
            raise access_error(remote, f"write the checkpoint of step {global_step} to", exc) from exc
        self._write_progress_quietly()

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints present, oldest first (temporary files, and on an
        object store files without their manifest, ignored)."""
        if self._remote is None:
            assert isinstance(self.directory, Path)
            names = [p.name for p in self.directory.iterdir()]
            wanted = "pt"
        else:
            fs, path = self._remote.fs, self._remote.path
            fs.invalidate_cache(path)
            try:
                names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
            except FileNotFoundError:
                names = []
            wanted = "json"
        found = (self._pattern.match(name) for name in names)
        return sorted(int(m.group(1)) for m in found if m and m.group(2) == wanted)

    def _unlisted(self, below: int) -> list[int]:
        """The steps under ``below`` with a file (object store) or shards but no checkpoint:
        a writer died between the parts and the file, or the file and its manifest."""
        if self._remote is None:
            assert isinstance(self.directory, Path)
            names = [p.name for p in self.directory.iterdir()]
            listed_kind = "pt"
        else:
            names = [
                entry.rstrip("/").rsplit("/", 1)[-1]
                for entry in self._remote.fs.ls(self._remote.path, detail=False)
            ]
            listed_kind = "json"
        found = [m for m in (self._pattern.match(name) for name in names) if m]
        listed = {int(m.group(1)) for m in found if m.group(2) == listed_kind}
        return sorted(
            {
                int(m.group(1))
                for m in found
                if m.group(2) != listed_kind and int(m.group(1)) not in listed and int(m.group(1)) < below
            }
        )

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
            source: Path | io.BytesIO = Path(path) if self._remote is None else self._fetch(global_step)
            state = torch.load(source, weights_only=True, map_location="cpu")
        except CheckpointError:
            raise
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

    def _fetch(self, global_step: int) -> io.BytesIO:
        """A complete checkpoint's bytes from the object store (its size checked against the manifest)."""
        remote = self._remote
        assert remote is not None
        self._uploads.wait()
        name = self._file(global_step)
        try:
            manifest = json.loads(remote.fs.cat_file(remote.child(self._file(global_step, "json"))))
            data = remote.fs.cat_file(remote.child(name))
        except FileNotFoundError as exc:
            raise CheckpointError(
                f"checkpoint of step {global_step} in {self.directory} is incomplete or gone ({exc}); "
                f"resume from another (steps present: {self.steps()})"
            ) from exc
        except Exception as exc:
            raise access_error(remote, f"read the checkpoint of step {global_step} from", exc) from exc
        expected = manifest.get("files", {}).get(name)
        if expected != len(data):
            raise CheckpointError(
                f"refused checkpoint {self.path_for(global_step)}: {len(data)} bytes, its manifest says "
                f"{expected}; it was altered: delete it and its .json to resume from the previous one"
            )
        return io.BytesIO(data)

    def record_progress(self, global_step: int) -> None:
        """Note the last step finished: locally overwritten in place, cheap enough for every
        step; on an object store written now and then (see the module's docstring)."""
        if self._remote is not None:
            self._progress = Progress(global_step, time.time())
            last = self._progress_written[1]
            if self._progress.wall_time - last >= PROGRESS_EVERY_S and not self._uploads.busy():
                self._uploads.submit("progress file", self._write_progress_quietly)
            return
        assert isinstance(self.directory, Path)
        if self._progress_fd is None:
            self._progress_fd = os.open(self.directory / "progress", os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._progress_fd, f"{global_step:012d} {time.time():.6f}\n".encode(), 0)

    def _write_progress(self) -> None:
        progress, remote = self._progress, self._remote
        if (
            progress is None
            or remote is None
            or (progress.step, progress.wall_time) == self._progress_written
        ):
            return
        text = f"{progress.step:012d} {progress.wall_time:.6f}\n".encode()
        try:
            remote.fs.pipe_file(remote.child("progress"), text)
        except Exception as exc:
            raise access_error(remote, "write the progress file in", exc) from exc
        self._progress_written = (progress.step, progress.wall_time)

    def _write_progress_quietly(self) -> None:
        """The progress file is a hint (how far the run got), not a checkpoint: a store that
        refuses it for a moment is logged and the training goes on."""
        try:
            self._write_progress()
        except CheckpointError as exc:
            log.warning("%s", exc)

    def progress(self) -> Progress | None:
        try:
            if self._remote is None:
                assert isinstance(self.directory, Path)
                text = (self.directory / "progress").read_text().split()
            else:
                text = self._remote.fs.cat_file(self._remote.child("progress")).decode().split()
            return Progress(int(text[0]), float(text[1]))
        except (OSError, ValueError, IndexError):
            return None

    def close(self, failing: bool = False) -> None:
        """Wait for the write in flight (an upload, or shards) and write the last progress
        (object store); close the progress file (local). ``failing``: training ended with an
        error, which must stay the one reported: the write gets at most :data:`FAILING_WAIT_S`
        and nothing is raised.

        Raises:
            CheckpointError: the last write failed or ran past its timeout (not ``failing``).
        """
        if self._progress_fd is not None:
            os.close(self._progress_fd)
            self._progress_fd = None
        if failing:
            self._uploads.settle(min(FAILING_WAIT_S, self._uploads.timeout_s))
            return
        self._uploads.wait()
        if self._remote is not None:
            self._write_progress_quietly()
