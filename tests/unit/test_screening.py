import numpy as np
import pyarrow as pa

from sparkdl.data.columns import LabelKind
from sparkdl.data.decoding import decode_block
from sparkdl.data.inputs import POSITIONAL, plan_data
from sparkdl.data.screening import RowScreen


def screened(screen, batch):
    """The rows the screen keeps, decoded as the feed decodes them (strictly)."""
    return decode_block(screen.screen(batch), screen.plan)


def test_skip_mode_drops_each_kind_of_bad_row_and_counts_it():
    batch = pa.RecordBatch.from_pydict(
        {
            "arr": pa.array(
                [
                    [1.0, 2.0],
                    None,
                    [3.0],
                    [4.0, None],
                    [5.0, 6.0],
                    [float("nan"), 1.0],
                    [7.0, 8.0],
                    [9.0, 9.0],
                ],
                pa.list_(pa.float32()),
            ),
            "x": pa.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, None, 8.0]),
            "label": pa.array([0, 1, 0, 1, 2, 0, 1, -1], pa.int64()),
        }
    )
    plan = plan_data(
        batch.schema, feature_cols=("arr", "x"), label_col="label", label_kind=LabelKind.CLASS_INDEX
    )
    screen = RowScreen(plan)
    block = screened(screen, batch)
    # kept: rows 0 and 4; dropped: null array, short array, null element, NaN, null x, label -1
    x, y = block.inputs[POSITIONAL], block.label
    np.testing.assert_array_equal(x, [[1, 2, 1], [5, 6, 5]])
    np.testing.assert_array_equal(y, [0, 2])
    assert y.dtype == np.int64 and screen.dropped == 6


def test_the_first_batch_fixes_the_array_width_for_the_partition():
    screen = RowScreen(
        plan_data(
            pa.schema([("arr", pa.list_(pa.float64())), ("label", pa.float64())]),
            feature_cols=("arr",),
            label_col="label",
            label_kind=LabelKind.REAL,
        )
    )
    first = pa.RecordBatch.from_pydict({"arr": [[1.0, 2.0], [3.0, 4.0], [5.0]], "label": [1.0, 2.0, 3.0]})
    second = pa.RecordBatch.from_pydict({"arr": [[1.0], [2.0], [3.0, 4.0]], "label": [1.0, 2.0, 3.0]})
    assert len(screened(screen, first).inputs[POSITIONAL]) == 2
    x = screened(screen, second).inputs[POSITIONAL]
    np.testing.assert_array_equal(x, [[3.0, 4.0]])
    assert screen.dropped == 3
