"""Checkpoint shards written by the ranks that hold them, read back under any layout.

fsdp's and tensor parallelism's parameters (and their optimizer state) are DTensors spread
over the ranks. Their checkpoints are written with ``torch.distributed.checkpoint`` (DCP):
each rank writes the shards it holds, in parallel, into one folder (a local directory, or
any fsspec URL), and the coordinator writes DCP's ``.metadata`` (what every file holds)
last; nothing is gathered to rank 0, whose memory would otherwise bound the model. Reading
reshards: a run with another number of ranks, or a strategy without shards, reads the
parts it needs (:func:`load_into`), or the whole model assembled in one process
(:func:`load_whole`).

DCP reads its ``.metadata`` with plain ``pickle`` and the non-tensor entries (the
optimizer's hyperparameters) with ``torch.load(weights_only=False)``: whoever can write the
checkpoint folder could run code in every worker that resumes from it. Here the metadata is
unpickled with DCP's own record types only, and every entry is read with
``weights_only=True``: a folder carrying pickled code is refused, as a checkpoint file is
(:meth:`~sparkdl.storage.checkpoint_store.CheckpointStore.load`).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from sparkdl.errors import CheckpointError

#: Where DCP's metadata may point when unpickled: its own record types, and the torch and
#: standard-library values they hold. Anything else (a function, a class with a
#: ``__reduce__`` that runs code) refuses the checkpoint.
_METADATA_MODULES = frozenset(
    {
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed.checkpoint.planner",
    }
)
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
_PLAIN_VALUES = frozenset(
    {
        ("torch.serialization", "_get_layout"),  # a layout by its name
        ("pathlib", "PosixPath"),  # where it was written (StorageMeta.checkpoint_id)
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES:
            return super().find_class(module, name)
        if module == "torch":
            found = getattr(torch, name, None)
            if name == "Size" or isinstance(found, _TORCH_VALUES):
                return found
        if (module, name) in _PLAIN_VALUES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class _SafeMetadata:
    """A DCP reader's ``read_metadata`` with :class:`_MetadataUnpickler`."""

    load_id: str
    fs: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(
                f"the metadata holds a {type(metadata).__name__}, not DCP's Metadata"
            )
        storage = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
        storage.load_id = self.load_id
        metadata.storage_meta = storage
        return metadata


class _SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    pass


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, its non-tensor entries read with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _writer(location: Path | str, options: Mapping[str, str]) -> Any:
    if isinstance(location, Path):
        return FileSystemWriter(location, single_file_per_rank=True, sync_files=True)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    settings: dict[str, Any] = dict(options)  # the filesystem's (fsspec's url_to_fs)
    return FsspecWriter(location, single_file_per_rank=True, sync_files=True, **settings)


def _reader(location: Path | str, options: Mapping[str, str]) -> Any:
    if isinstance(location, Path):
        return _SafeFileSystemReader(location)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class _SafeFsspecReader(_SafeMetadata, FsspecReader):
        pass

    return _SafeFsspecReader(location, **dict(options))


def stage(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` in host memory (its DTensors' local shards copied, their layout
    kept) that training may go on from while the copy is written: what DCP's ``async_save``
    stages before its writing thread starts."""
    plain = StagingOptions(
        use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
    )  # as async_save stages: into ordinary host memory, on this thread
    stager = DefaultStager(plain)
    try:
        return cast(dict[str, Any], stager.stage(state))
    finally:
        stager.close()


def save(
    state: dict[str, Any],
    location: Path | str,
    options: Mapping[str, str] = {},
    group: dist.ProcessGroup | None = None,
) -> None:
    """Every rank of ``group`` (the default one when None): write the shards of ``state``
    this rank holds into ``location`` (a collective over the group, which may run on a
    thread of its own: a group no other thread uses; DCP's metadata is written last).

    Raises:
        CheckpointError: a rank could not write (every rank raises it).
    """
    try:
        dcp.save(state, storage_writer=_writer(location, options), process_group=group)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        raise CheckpointError(
            f"could not write the checkpoint shards to {location}: {type(exc).__name__}: {str(exc)[:300]}; "
            "check checkpoint_dir (its space, its permissions, the store's credentials)"
        ) from exc


def load_into(state: dict[str, Any], location: Path | str, options: Mapping[str, str] = {}) -> None:
    """Every rank (a collective where a process group runs): fill ``state`` (the layout this
    run holds: DTensors, or whole tensors) in place from the checkpoint in ``location``.

    Raises:
        CheckpointError: the folder is incomplete, altered, or carries pickled code.
    """
    try:
        dcp.load(state, storage_reader=_reader(location, options), planner=_SafeLoadPlanner())
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        raise _refused(location, exc) from exc


def load_whole(location: Path | str, options: Mapping[str, str] = {}) -> dict[str, Any]:
    """The whole checkpoint in ``location`` assembled in this process (no process group
    needed): plain tensors, nested as it was saved.

    Raises:
        CheckpointError: the folder is incomplete, altered, or carries pickled code.
    """
    try:
        reader = _reader(location, options)
        state = _skeleton(reader.read_metadata())
        dcp.load(state, storage_reader=reader, planner=_SafeLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        raise _refused(location, exc) from exc
    return state


def _skeleton(metadata: Metadata) -> dict[str, Any]:
    """The saved state's nesting (DCP's ``planner_data``: each flat key's path of dict keys
    and list indices), each tensor allocated empty and each other entry ``None``, for DCP to
    fill."""
    state: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        value = (
            torch.empty(entry.size, dtype=entry.properties.dtype)
            if isinstance(entry, TensorStorageMetadata)
            else None
        )
        set_element(state, (metadata.planner_data or {}).get(key, (key,)), value)
    return state


def _refused(location: Path | str, exc: BaseException) -> CheckpointError:
    text = f"{type(exc).__name__}: {str(exc)[:300]}"
    return CheckpointError(
        f"refused the checkpoint shards in {location}: {text}. They were not written by sparkdl, are "
        "incomplete, or were altered; delete the checkpoint to resume from the previous one, or start "
        "afresh with a new checkpoint_dir"
    )
