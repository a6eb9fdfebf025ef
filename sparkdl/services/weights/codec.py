"""A state dict as a manifest plus one stream of raw tensor bytes, and back (pure torch).

The manifest lists each entry's name, dtype and shape, in order; the bytes of every
tensor follow in the same order, each tensor's native (little-endian, C-contiguous)
bytes. An entry that is the same tensor as an earlier one (tied weights: an embedding
and the output layer that shares it) is sent once and named as an alias, so the
receiver rebuilds one tensor for both and the bytes cross the wire once.

The receiver allocates every tensor from the manifest up front and copies each chunk
straight into place (:class:`StateAssembler`): no second copy of the model is held.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sparkdl.errors import ProtocolError

#: dtypes a manifest may name, by the name it names them with.
DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
MAX_ENTRIES = 1_000_000
MAX_NAME_CHARS = 4096
MAX_DIMS = 32
MAX_TENSOR_BYTES = 1 << 40  # 1 TiB: a larger tensor is a forged manifest, not a model


@dataclass(frozen=True)
class Entry:
    """One state dict entry: its tensor's dtype and shape, or the earlier entry it aliases."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    alias: str = ""  # the earlier entry that holds this very tensor ("": its own bytes follow)

    @property
    def nbytes(self) -> int:
        if self.alias:
            return 0
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize  # Python ints: no overflow


def manifest_of(state: Mapping[str, torch.Tensor]) -> tuple[list[Entry], list[torch.Tensor]]:
    """The entries of ``state`` and the tensors whose bytes follow (aliases left out)."""
    entries: list[Entry] = []
    tensors: list[torch.Tensor] = []
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in state.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise TypeError(f"state entry {name!r} has dtype {tensor.dtype}, which cannot be sent")
        identity = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        shape = tuple(int(d) for d in tensor.shape)
        if tensor.numel() and identity in seen:
            entries.append(Entry(name, dtype, shape, alias=seen[identity]))
            continue
        seen[identity] = name
        entries.append(Entry(name, dtype, shape))
        tensors.append(tensor)
    return entries, tensors


def total_bytes(entries: list[Entry]) -> int:
    return sum(entry.nbytes for entry in entries)


def encode_manifest(entries: list[Entry]) -> bytes:
    return json.dumps([[e.name, e.dtype, list(e.shape), e.alias] for e in entries]).encode()


def decode_manifest(payload: bytes | bytearray) -> list[Entry]:
    """The entries of a manifest, every field checked.

    Raises:
        ProtocolError: not a manifest, or a name, dtype, shape or alias it may not hold.
    """
    try:
        rows = json.loads(bytes(payload))
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"weights manifest is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(rows, list) or len(rows) > MAX_ENTRIES:
        raise ProtocolError(f"weights manifest must be a list of at most {MAX_ENTRIES} entries")
    entries: list[Entry] = []
    by_name: dict[str, Entry] = {}
    for row in rows:
        entry = _entry(row, by_name)
        by_name[entry.name] = entry
        entries.append(entry)
    return entries


def _entry(row: Any, earlier: dict[str, Entry]) -> Entry:
    if not (isinstance(row, list) and len(row) == 4):
        raise ProtocolError(f"weights manifest entry {str(row)[:80]!r} is not [name, dtype, shape, alias]")
    name, dtype, shape, alias = row
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or name in earlier:
        raise ProtocolError(f"weights manifest entry name {str(name)[:80]!r} is empty, too long or repeated")
    if dtype not in DTYPES:
        raise ProtocolError(
            f"weights manifest entry {name!r} has dtype {str(dtype)[:40]!r}, not one of {sorted(DTYPES)}"
        )
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_DIMS
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_TENSOR_BYTES for d in shape)
        and Entry(name, dtype, tuple(shape)).nbytes <= MAX_TENSOR_BYTES
    ):
        raise ProtocolError(f"weights manifest entry {name!r} has shape {str(shape)[:80]}")
    target = earlier.get(alias) if isinstance(alias, str) and alias else None
    if not isinstance(alias, str) or (alias and (target is None or target.alias)):
        raise ProtocolError(
            f"weights manifest entry {name!r} aliases {str(alias)[:80]!r}, not an earlier entry"
        )
    if target is not None and (target.dtype, target.shape) != (dtype, tuple(shape)):
        raise ProtocolError(f"weights manifest entry {name!r} aliases {alias!r} of another dtype or shape")
    return Entry(name, dtype, tuple(shape), alias)


def byte_chunks(tensors: list[torch.Tensor], chunk_bytes: int) -> Iterator[memoryview]:
    """The bytes of ``tensors``, in order, as views of at most ``chunk_bytes`` (no copy of a
    contiguous CPU tensor; another is copied one tensor at a time)."""
    for tensor in tensors:
        data = _raw(tensor.detach().cpu().contiguous())
        for start in range(0, data.nbytes, chunk_bytes):
            yield data[start : start + chunk_bytes]


def _raw(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, uncopied (any dtype, 0-d included)."""
    array: Any = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)


class StateAssembler:
    """Rebuilds a state dict from its manifest and its byte stream, chunk by chunk.

    Every tensor is allocated when the assembler is made; each chunk is copied into the
    tensors it covers, in order.
    """

    def __init__(self, entries: list[Entry]) -> None:
        self._entries = entries
        self._tensors = {e.name: torch.empty(e.shape, dtype=DTYPES[e.dtype]) for e in entries if not e.alias}
        self._targets = [_raw(t) for t in self._tensors.values() if t.numel()]
        self._target = 0  # index of the tensor being filled
        self._filled = 0  # bytes of it filled
        self.received = 0
        self.expected = total_bytes(entries)

    def target(self, length: int) -> memoryview | None:
        """Where the next ``length`` bytes go, when they fall inside one tensor (the
        socket then reads into the tensor itself); None otherwise."""
        if self._target >= len(self._targets) or self.received + length > self.expected:
            return None
        target = self._targets[self._target]
        if self._filled + length > target.nbytes:
            return None
        return target[self._filled : self._filled + length]

    def advance(self, length: int) -> None:
        """The next ``length`` bytes were written into :meth:`target`'s view."""
        self._filled += length
        self.received += length
        if self._filled == self._targets[self._target].nbytes:
            self._target, self._filled = self._target + 1, 0

    def add(self, data: bytes | bytearray | memoryview) -> None:
        """Copy the next ``data`` bytes of the stream into place.

        Raises:
            ProtocolError: more bytes than the manifest announced.
        """
        view = memoryview(data).cast("B")
        if self.received + view.nbytes > self.expected:
            raise ProtocolError(
                f"weights stream sent {self.received + view.nbytes} bytes, "
                f"the manifest announced {self.expected}"
            )
        while view.nbytes:
            target = self._targets[self._target]
            n = min(view.nbytes, target.nbytes - self._filled)
            target[self._filled : self._filled + n] = view[:n]
            view = view[n:]
            self._filled += n
            self.received += n
            if self._filled == target.nbytes:
                self._target, self._filled = self._target + 1, 0

    def finish(self) -> dict[str, torch.Tensor]:
        """The state dict, in manifest order, aliases pointing at their tensor.

        Raises:
            ProtocolError: fewer bytes arrived than the manifest announced.
        """
        if self.received != self.expected:
            raise ProtocolError(
                f"weights stream ended after {self.received} of the {self.expected} bytes "
                "its manifest announced"
            )
        state: dict[str, torch.Tensor] = {}
        for entry in self._entries:
            state[entry.name] = state[entry.alias] if entry.alias else self._tensors[entry.name]
        return state
