"""``on_bad_rows = "skip"``: drop the rows that cannot be trained on, and count them.

The same checks as the strict decoder (nulls, null array elements, arrays or images of
the wrong size, NaN or infinite values, unusable labels or weights), but each yields a
row mask instead of an error. Structural checks run on the Arrow batch (Arrow compute,
no Python per row), numeric ones on the decoded arrays. Array widths and image sizes
are fixed by the first batch (its most common one) and then held for the whole
partition, so every kept row has the same shape. What transform_fn returns is checked
strictly (an error, not a skip): only the columns sparkdl decodes are screened.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkdl.data.blocks import Ragged, values_of
from sparkdl.data.columns import ColumnKind, ColumnSpec, bad_label_rows, flat_rows, label_values
from sparkdl.data.decoding import decode_input
from sparkdl.data.inputs import DataPlan, InputKind


class RowScreen:
    """Filters record batches of one partition; ``dropped`` counts the rows left out."""

    def __init__(self, plan: DataPlan) -> None:
        self.plan = plan
        self.dropped = 0
        self._sizes: dict[str, Any] = {}

    def screen(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The rows of ``batch`` that decode cleanly."""
        keep = np.ones(batch.num_rows, dtype=bool)
        for spec, sequence in self._columns():
            keep &= self._structurally_sound(batch.column(spec.name), spec, sequence)
        batch = self._filter(batch, keep)
        bad = np.zeros(batch.num_rows, dtype=bool)
        for input_spec in self.plan.inputs:
            if input_spec.kind is InputKind.TEXT:  # token ids are never NaN: not tokenized twice
                continue
            column = decode_input(batch, input_spec)
            values = values_of(column)
            if values.dtype.kind != "f" or not len(values):
                continue
            finite = np.isfinite(flat_rows(values)).all(axis=1)
            if isinstance(column, Ragged):
                bad |= column.rows_where(~finite)
            else:
                bad |= ~finite
        if self.plan.label is not None:
            mask = bad_label_rows(label_values(batch, self.plan.label), self.plan.label_kind)
            if mask is not None:
                bad |= mask
        if self.plan.weight is not None:
            weights = label_values(batch, self.plan.weight)
            bad |= ~np.isfinite(weights) | (weights < 0)
        return self._filter(batch, ~bad)

    def _filter(self, batch: pa.RecordBatch, keep: np.ndarray) -> pa.RecordBatch:
        if keep.all():
            return batch
        self.dropped += int((~keep).sum())
        return batch.filter(pa.array(keep))

    def _columns(self) -> list[tuple[ColumnSpec, bool]]:
        ragged = (InputKind.SEQUENCE, InputKind.TEXT)  # texts: only nulls are bad
        out = [(c, spec.kind in ragged) for spec in self.plan.inputs for c in spec.columns]
        out += [(c, False) for c in (self.plan.label, self.plan.weight) if c is not None]
        return out

    def _structurally_sound(self, column: pa.Array, spec: ColumnSpec, sequence: bool) -> np.ndarray:
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        valid = pc.is_valid(column).to_numpy(zero_copy_only=False)
        if spec.kind is ColumnKind.SCALAR:
            return valid
        if spec.kind is ColumnKind.IMAGE:
            return valid & self._sound_images(column, spec.name, valid)
        if spec.kind is ColumnKind.VECTOR:
            values = pc.struct_field(column, "values")
            sparse = pc.equal(pc.struct_field(column, "type"), 0).fill_null(False)
            sizes = pc.if_else(sparse, pc.struct_field(column, "size"), pc.list_value_length(values))
            lengths = sizes.fill_null(-1).to_numpy(zero_copy_only=False)
            leaf_rows = pc.list_parent_indices(values).to_numpy(zero_copy_only=False)
            leaves = pc.list_flatten(values)
        else:  # arrays, nested arrays (judged by their count of numbers) and sequences
            leaf_rows, leaves = _leaves(column)
            lengths = np.bincount(leaf_rows, minlength=len(column))
        sound = valid.copy()
        if not sequence:
            width = self._held(spec.name, [int(v) for v in lengths[valid]])
            sound &= lengths == (width if width is not None else -2)
        if leaves.null_count:
            null_leaves = pc.is_null(leaves).to_numpy(zero_copy_only=False)
            sound[np.unique(leaf_rows[null_leaves])] = False
        return sound

    def _sound_images(self, column: pa.Array, name: str, valid: np.ndarray) -> np.ndarray:
        fields = ("height", "width", "nChannels")
        sizes = np.stack(
            [pc.struct_field(column, f).fill_null(-1).to_numpy(zero_copy_only=False) for f in fields], axis=1
        )
        data = pc.binary_length(pc.struct_field(column, "data")).fill_null(-1).to_numpy(zero_copy_only=False)
        sound = valid & (data == sizes.prod(axis=1))
        size = self._held(name, [tuple(int(v) for v in row) for row in sizes[sound]])
        if size is None:
            return np.zeros(len(column), dtype=bool)
        return sound & (sizes == np.asarray(size)).all(axis=1)

    def _held(self, name: str, seen: list[Any]) -> Any:
        """The size of ``name`` every kept row must have: the first batch's most common one."""
        if name not in self._sizes and seen:
            self._sizes[name] = Counter(seen).most_common(1)[0][0]
        return self._sizes.get(name)


def _leaves(column: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """A (nested) list column's numbers, and for each the row it belongs to."""
    rows: np.ndarray | None = None
    level = column
    while (
        pa.types.is_list(level.type)
        or pa.types.is_large_list(level.type)
        or pa.types.is_fixed_size_list(level.type)
    ):
        parents = pc.list_parent_indices(level).to_numpy(zero_copy_only=False)
        rows = parents if rows is None else rows[parents]
        level = pc.list_flatten(level)
    return (rows if rows is not None else np.arange(len(column))), level
