"""Rows of decoded inputs held as numpy arrays: :class:`Block`, and :class:`Ragged` for
sequences whose rows differ in length.

A block is what the feed moves between decoding, shuffling, the epoch cache and
batching: named inputs (fixed-shape arrays, or ragged sequences as values + offsets),
the label and the per-row weight, all with the same number of rows. Every row operation
(slice, gather, concatenate) is a handful of numpy calls per column, never a Python loop
over rows. Pure numpy: no torch, no Spark.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

RowIndex = slice | np.ndarray
# (shape, dtype) -> an uninitialised array to write a result into (e.g. pooled memory)
Allocate = Callable[[tuple[int, ...], np.dtype], np.ndarray]


@dataclass(slots=True)  # built per batch: slots, not frozen, keep construction cheap
class Ragged:
    """Rows of different lengths: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``.

    Attributes:
        values: every row's elements, one after another, ``[total, *element_shape]``.
        offsets: int64 ``[rows + 1]``, non-decreasing (``offsets[0]`` need not be 0).
    """

    values: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def rows(self, index: RowIndex) -> Ragged:
        """The rows selected by a slice (a view) or an integer array (a gather)."""
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                index = np.arange(start, stop, step)
            else:
                return Ragged(
                    self.values, self.offsets[start : stop + 1] if stop > start else self.offsets[:1]
                )
        starts = self.offsets[:-1][index]
        # not self.lengths[index]: that diffs every row of the column (the whole epoch cache)
        # for each gathered batch
        lengths = self.offsets[1:][index] - starts
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # element j of the result comes from starts[row] + (j - offsets[row])
        positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
        return Ragged(self.values[positions], offsets)

    def rows_where(self, flags: np.ndarray) -> np.ndarray:
        """Rows holding at least one element whose flag is set (one flag per element of
        ``values``), as a bool mask ``[rows]``."""
        hits = np.zeros(len(self), dtype=bool)
        row_of = np.repeat(np.arange(len(self)), self.lengths)
        hits[row_of[flags[int(self.offsets[0]) : int(self.offsets[-1])]]] = True
        return hits

    def compact(self) -> Ragged:
        """The same rows with ``offsets[0] == 0`` and no elements outside them."""
        first, last = int(self.offsets[0]), int(self.offsets[-1])
        return Ragged(self.values[first:last], self.offsets - first)

    @staticmethod
    def concat(parts: Sequence[Ragged], allocate: Allocate | None = None) -> Ragged:
        compacted = [p.compact() for p in parts]
        values = _concat([p.values for p in compacted], allocate)
        lengths = np.concatenate([p.lengths for p in compacted])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Ragged(values, offsets)

    def padded(self, cap: int = 0, pad: float = 0, fixed: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Rows padded to the longest (at most ``cap`` when > 0, longer rows keep their
        first ``cap`` elements; to ``cap`` itself when ``fixed``) with ``pad``:
        ``(values [rows, L, *element], mask bool [rows, L])``."""
        lengths = self.lengths
        if cap > 0:
            lengths = np.minimum(lengths, cap)
        width = cap if fixed and cap > 0 else int(lengths.max()) if len(lengths) else 0
        out = np.full((len(self), width, *self.values.shape[1:]), pad, dtype=self.values.dtype)
        mask = np.arange(width) < lengths[:, None]
        rows = np.repeat(np.arange(len(self)), lengths)
        cols = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        source = np.repeat(self.offsets[:-1], lengths) + cols
        out[rows, cols] = self.values[source]
        return out, mask


Column = np.ndarray | Ragged


def values_of(column: Column) -> np.ndarray:
    """A column's elements: the array itself, or a sequence's values (every row's, in a row)."""
    return column.values if isinstance(column, Ragged) else column


def take_rows(column: Column, index: RowIndex) -> Column:
    return column.rows(index) if isinstance(column, Ragged) else column[index]


def concat_rows(parts: Sequence[Column], allocate: Allocate | None = None) -> Column:
    """The rows of ``parts`` one after another; ``allocate`` provides the joined values."""
    if isinstance(parts[0], Ragged):
        return Ragged.concat(parts, allocate)  # type: ignore[arg-type]
    return _concat(parts, allocate)  # type: ignore[arg-type]


def _concat(arrays: Sequence[np.ndarray], allocate: Allocate | None) -> np.ndarray:
    if allocate is None:
        return np.concatenate(arrays)
    out = allocate((sum(len(a) for a in arrays), *arrays[0].shape[1:]), arrays[0].dtype)
    return np.concatenate(arrays, out=out)


@dataclass(slots=True)  # built per batch: slots, not frozen, keep construction cheap
class Block:
    """Decoded rows: the model's named inputs, the label and the per-row weight.

    Attributes:
        inputs: input name -> ``[rows, ...]`` array or :class:`Ragged` sequence.
        label: ``[rows, ...]`` targets, or None (inference).
        weight: float32 ``[rows]`` per-row loss weights, or None.
    """

    inputs: dict[str, Column]
    label: np.ndarray | None = None
    weight: np.ndarray | None = None

    def __len__(self) -> int:
        for column in (self.label, *self.inputs.values()):
            if column is not None:
                return len(column)
        return 0

    def rows(self, index: RowIndex) -> Block:
        """The rows selected by a slice (views where possible) or an integer array."""
        return Block(
            {name: take_rows(column, index) for name, column in self.inputs.items()},
            None if self.label is None else self.label[index],
            None if self.weight is None else self.weight[index],
        )

    @staticmethod
    def concat(blocks: Sequence[Block]) -> Block:
        if len(blocks) == 1:
            return blocks[0]
        first = blocks[0]
        return Block(
            {name: concat_rows([b.inputs[name] for b in blocks]) for name in first.inputs},
            None if first.label is None else np.concatenate([b.label for b in blocks]),
            None if first.weight is None else np.concatenate([b.weight for b in blocks]),
        )

    def columns(self) -> dict[str, Column]:
        """Every column by a storage name (inputs under their own name, then the label and
        the weight under reserved names), e.g. for the epoch cache."""
        out: dict[str, Column] = {f"input:{name}": column for name, column in self.inputs.items()}
        if self.label is not None:
            out["label"] = self.label
        if self.weight is not None:
            out["weight"] = self.weight
        return out

    @staticmethod
    def from_columns(columns: dict[str, Column]) -> Block:
        """The inverse of :meth:`columns`."""
        inputs = {name[len("input:") :]: c for name, c in columns.items() if name.startswith("input:")}
        label, weight = columns.get("label"), columns.get("weight")
        return Block(inputs, label, weight)  # type: ignore[arg-type]
