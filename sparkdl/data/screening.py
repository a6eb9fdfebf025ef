"""``on_bad_rows = "skip"``: drop the rows that cannot be trained on, and count them.

The same checks as the strict decoder (nulls, null array elements, arrays of the
wrong length, NaN or infinite values, unusable labels), but each yields a row mask
instead of an error. Structural checks run on the Arrow batch (Arrow compute, no
Python per row), numeric ones on the decoded arrays. Array widths are fixed by the
first batch (its most common length) and then held for the whole partition, so
every kept row has the same shape.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkdl.data.batching import Arrays
from sparkdl.data.columns import (
    ColumnKind,
    ColumnPlan,
    ColumnSpec,
    as_label,
    bad_label_rows,
    feature_matrix,
    label_values,
    nonfinite_rows,
)


class RowScreen:
    """Decodes batches leniently for one partition; ``dropped`` counts the rows left out."""

    def __init__(self, plan: ColumnPlan) -> None:
        self.plan = plan
        self.dropped = 0
        self._widths: dict[str, int] = {}

    def decode(self, batch: pa.RecordBatch) -> Arrays:
        """The good rows of ``batch`` as (features, labels)."""
        keep = np.ones(batch.num_rows, dtype=bool)
        specs = [*self.plan.features, *([self.plan.label] if self.plan.label else [])]
        for spec in specs:
            keep &= self._structurally_sound(batch.column(spec.name), spec)
        if not keep.all():
            batch = batch.filter(pa.array(keep))
        x = feature_matrix(batch, self.plan)
        y = label_values(batch, self.plan)
        bad = np.zeros(len(x), dtype=bool)
        for mask in (nonfinite_rows(x), bad_label_rows(y, self.plan.label_kind)):
            if mask is not None:
                bad |= mask
        self.dropped += int((~keep).sum()) + int(bad.sum())
        if bad.any():
            x, y = x[~bad], y[~bad]
        return x, as_label(y, self.plan.label_kind)

    def _structurally_sound(self, column: pa.Array, spec: ColumnSpec) -> np.ndarray:
        valid = pc.is_valid(column).to_numpy(zero_copy_only=False)
        if spec.kind is ColumnKind.SCALAR:
            return valid
        if spec.kind is ColumnKind.VECTOR:
            values = pc.struct_field(column, "values")
            sparse = pc.equal(pc.struct_field(column, "type"), 0).fill_null(False)
            sizes = pc.if_else(sparse, pc.struct_field(column, "size"), pc.list_value_length(values))
            lengths = sizes.fill_null(-1).to_numpy(zero_copy_only=False)
        else:
            values = column
            lengths = pc.list_value_length(column).fill_null(-1).to_numpy(zero_copy_only=False)
        if spec.name not in self._widths and valid.any():
            self._widths[spec.name] = _most_common(lengths[valid])
        width = self._widths.get(spec.name, -2)
        sound = valid & (lengths == width)
        elements = pc.list_flatten(values)
        if elements.null_count:
            parents = pc.list_parent_indices(values).to_numpy(zero_copy_only=False)
            null_elements = pc.is_null(elements).to_numpy(zero_copy_only=False)
            sound[np.unique(parents[null_elements])] = False
        return sound


def _most_common(lengths: np.ndarray) -> int:
    values, counts = np.unique(lengths, return_counts=True)
    return int(values[counts.argmax()])
