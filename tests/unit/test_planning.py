"""Step planning: every worker takes the same steps, whatever its rows."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from sparkdl.data.tensors import Batch
from sparkdl.training.planning import (
    Filler,
    InputRejected,
    ScheduledCoordinator,
    StepControl,
    StepPlan,
    StreamingCoordinator,
    coordinator_for,
    exchange_row_counts,
)

_all_reduce = functools.partial(dist.all_reduce, group=None)  # the default (gloo) group


def test_the_step_control_sums_rows_and_counts_the_workers_holding_rows():
    ranks = [
        StepControl.local(8, failed=False),
        StepControl.local(0, failed=False),
        StepControl.local(3, False),
    ]
    summed = StepControl(*[sum(getattr(r, f) for r in ranks) for f in StepControl.__dataclass_fields__])
    assert summed == StepControl(11.0, 2.0, 0.0) and summed.plan() == StepPlan(11)
    assert StepControl.local(0, failed=False).plan() is None


def test_the_schedule_of_epochs_2_plus_is_a_pure_function_of_the_counts():
    coordinator = ScheduledCoordinator([5, 0, 3], batch_size=2)
    assert coordinator.total_steps == 3 and not coordinator.streaming
    plans = [coordinator.next_step(0) for _ in range(4)]
    assert plans == [StepPlan(4), StepPlan(3), StepPlan(1), None]


def test_a_resumed_schedule_skips_the_steps_done_before_the_failure():
    coordinator = ScheduledCoordinator([5, 3], batch_size=2)
    coordinator.skip()
    coordinator.skip()
    assert coordinator.next_step(1) == StepPlan(1)
    assert coordinator.next_step(0) is None


def test_streaming_steps_agree_over_the_control_group_and_a_rejection_stops_everyone(gloo_group):
    coordinator = StreamingCoordinator(_all_reduce)
    assert coordinator.streaming and coordinator.total_steps == -1
    assert coordinator.next_step(8) == StepPlan(8)
    assert coordinator.next_step(0) is None
    with pytest.raises(InputRejected):
        coordinator.next_step(8, failed=True)


def test_row_counts_are_exchanged_in_one_all_reduce(gloo_group):
    assert exchange_row_counts(0, 1, 12, _all_reduce) == [12]


def test_the_coordinator_streams_only_while_the_data_comes_from_spark(gloo_group):
    counts = exchange_row_counts(0, 1, 12, _all_reduce)
    assert coordinator_for(True, None, 4, _all_reduce).streaming
    scheduled = coordinator_for(False, counts, 4, _all_reduce)
    assert not scheduled.streaming and scheduled.total_steps == 3


def _batch(rows: int, fill: float = 0.0) -> Batch:
    return Batch(
        {"ids": torch.arange(rows), "x": torch.full((rows, 3), fill)},
        torch.arange(rows) % 2,
        torch.ones(rows),
    )


def test_a_worker_that_never_had_rows_steps_on_the_template_the_driver_decoded():
    template = _batch(2, fill=7.0)
    filler = Filler(template)
    assert filler.batch() is template


def test_a_worker_whose_rows_ran_out_steps_on_two_rows_it_saw():
    filler = Filler(_batch(2, fill=-1.0))
    filler.remember(_batch(0))  # empty: not remembered
    seen = Batch(
        {"ids": torch.tensor([5, 6, 7, 8]), "x": torch.arange(12.0).view(4, 3)}, torch.tensor([2, 1, 0, 1])
    )
    filler.remember(seen)
    filler.remember(_batch(4, fill=1.0))  # the first one stays
    got = filler.batch()
    assert torch.equal(got.inputs["x"], seen.inputs["x"][:2]) and torch.equal(
        got.inputs["ids"], torch.tensor([5, 6])
    )
    assert torch.equal(got.label, seen.label[:2]) and got.weight is None
    seen.inputs["x"].zero_()  # a copy, not a view of a batch the feed may reuse
    assert got.inputs["x"].sum() == 15.0


def test_without_rows_or_a_template_the_filler_says_why():
    with pytest.raises(RuntimeError, match="no rows and has no template"):
        Filler(None).batch()
