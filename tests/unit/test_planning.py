"""Step planning: every worker takes the same steps, whatever its rows."""

from __future__ import annotations

import pytest
import torch

from sparkdl.data.columns import LabelKind
from sparkdl.training.planning import (
    BatchShape,
    Filler,
    InputRejected,
    PartitionMessage,
    ScheduledCoordinator,
    StepControl,
    StepPlan,
    StreamingCoordinator,
    coordinator_for,
    exchange_partition_info,
)


def test_the_step_control_sums_rows_and_agrees_on_the_widths_of_the_workers_holding_rows():
    ranks = [
        StepControl.local(BatchShape(8, 6, 1), failed=False),
        StepControl.local(BatchShape(0, 0, 1), failed=False),  # out of rows: its widths do not count
        StepControl.local(BatchShape(3, 6, 1), failed=False),
    ]
    summed = StepControl(*[sum(getattr(r, f) for r in ranks) for f in StepControl.__dataclass_fields__])
    assert summed.plan() == StepPlan(11, 6, 1)
    nobody = StepControl.local(BatchShape(0, 0, 1), failed=False)
    assert nobody.plan() is None


def test_the_partition_message_layout_round_trips_through_a_sum():
    message = PartitionMessage(world_size=3)
    vectors = [message.pack(0, 40, (6, 1)), message.pack(1, 0, (0, 1)), message.pack(2, 17, (6, 1))]
    info = message.unpack(sum(vectors))
    assert info.counts == [40, 0, 17] and info.widths == (6, 1) and info.total_rows == 57
    empty = message.unpack(message.pack(0, 0, (0, 1)) * 0)
    assert empty.widths == (0, 1) and empty.total_rows == 0


def test_the_schedule_of_epochs_2_plus_is_a_pure_function_of_the_counts():
    coordinator = ScheduledCoordinator([5, 0, 3], batch_size=2, widths=(4, 1))
    assert coordinator.total_steps == 3 and not coordinator.streaming
    plans = [coordinator.next_step(BatchShape(0, 0, 1)) for _ in range(4)]
    assert plans == [StepPlan(4, 4, 1), StepPlan(3, 4, 1), StepPlan(1, 4, 1), None]


def test_a_resumed_schedule_skips_the_steps_done_before_the_failure():
    coordinator = ScheduledCoordinator([5, 3], batch_size=2, widths=(4, 1))
    coordinator.skip()
    coordinator.skip()
    assert coordinator.next_step(BatchShape(1, 4, 1)) == StepPlan(1, 4, 1)
    assert coordinator.next_step(BatchShape(0, 0, 1)) is None


def test_streaming_steps_agree_over_the_control_group_and_a_rejection_stops_everyone(gloo_group):
    coordinator = StreamingCoordinator(None)
    assert coordinator.streaming and coordinator.total_steps == -1
    assert coordinator.next_step(BatchShape(8, 6, 3)) == StepPlan(8, 6, 3)
    assert coordinator.next_step(BatchShape(0, 0, 1)) is None
    with pytest.raises(InputRejected):
        coordinator.next_step(BatchShape(8, 6, 1), failed=True)


def test_partition_info_is_exchanged_in_one_all_reduce(gloo_group):
    info = exchange_partition_info(0, 1, 12, (6, 1), None)
    assert info.counts == [12] and info.widths == (6, 1)


def test_the_coordinator_streams_only_while_the_data_comes_from_spark(gloo_group):
    info = exchange_partition_info(0, 1, 12, (6, 1), None)
    assert coordinator_for(True, None, 4, None).streaming
    scheduled = coordinator_for(False, info, 4, None)
    assert not scheduled.streaming and scheduled.total_steps == 3


@pytest.mark.parametrize(
    ("kind", "plan", "x_shape", "y_shape", "y_dtype"),
    [
        (LabelKind.CLASS_INDEX, StepPlan(4, 6, 1), (2, 6), (2,), torch.int64),
        (LabelKind.REAL, StepPlan(4, 6, 1), (2, 6), (2,), torch.float32),
        (LabelKind.REAL, StepPlan(4, 5, 3), (2, 5), (2, 3), torch.float32),
    ],
)
def test_a_worker_that_never_had_rows_steps_on_zeros_of_the_agreed_widths(
    kind, plan, x_shape, y_shape, y_dtype
):
    x, y = Filler(kind).batch(plan)
    assert x.shape == x_shape and y.shape == y_shape and y.dtype == y_dtype
    assert not x.any() and not y.any()


def test_a_worker_whose_rows_ran_out_steps_on_two_rows_it_saw():
    filler = Filler(LabelKind.CLASS_INDEX)
    filler.remember((torch.empty(0, 3), torch.empty(0, dtype=torch.int64)))  # empty: not remembered
    seen = (torch.arange(12.0).view(4, 3), torch.tensor([2, 1, 0, 1]))
    filler.remember(seen)
    filler.remember((torch.ones(4, 3), torch.zeros(4, dtype=torch.int64)))  # the first one stays
    x, y = filler.batch(StepPlan(4, 3, 1))
    assert torch.equal(x, seen[0][:2]) and torch.equal(y, seen[1][:2])
