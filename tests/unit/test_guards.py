"""The non-finite step guard: what is skipped, what stops, and who raises when."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparkdl.config import OnError
from sparkdl.errors import PeerStopped, TrainingFailedError
from sparkdl.training.guards import NanGuard

NAN = torch.tensor(float("nan"))
FINE = torch.tensor(0.5)


def model_with_grad(value: float) -> nn.Module:
    layer = nn.Linear(2, 1)
    for p in layer.parameters():
        p.grad = torch.full_like(p, value)
    return layer


def test_skip_counts_and_stops_after_max_skips_in_a_row():
    guard = NanGuard(OnError.SKIP, max_skips=2, rank=1)
    assert not guard.allows_step(NAN, model_with_grad(1.0), 1, 0)
    assert guard.allows_step(FINE, model_with_grad(1.0), 1, 1)  # a finite step resets the streak
    assert not guard.allows_step(NAN, model_with_grad(1.0), 1, 2)
    assert not guard.allows_step(NAN, model_with_grad(1.0), 1, 3)
    with pytest.raises(TrainingFailedError, match=r"3 steps in a row .* rank 1 \(last at epoch 1, step 4\)"):
        guard.allows_step(NAN, model_with_grad(1.0), 1, 4)
    assert guard.skipped == 4


def test_with_shared_gradients_a_non_finite_average_stops_every_rank_together():
    culprit = NanGuard(OnError.ERROR, 10, rank=1, shares_gradients=True)
    with pytest.raises(TrainingFailedError, match="at rank 1, epoch 2, step 7") as raised:
        culprit.allows_step(NAN, model_with_grad(float("nan")), 2, 7)
    assert raised.value.agreed_by_all_ranks  # type: ignore[attr-defined]
    bystander = NanGuard(OnError.ERROR, 10, rank=0, shares_gradients=True)
    with pytest.raises(PeerStopped, match="rank 0's own loss was finite") as raised:
        bystander.allows_step(FINE, model_with_grad(float("inf")), 2, 7)
    assert raised.value.agreed_by_all_ranks  # type: ignore[attr-defined]


def test_a_non_finite_loss_with_finite_gradients_is_this_rank_s_failure_alone():
    guard = NanGuard(OnError.ERROR, 10, rank=1, shares_gradients=True)
    with pytest.raises(TrainingFailedError) as raised:
        guard.allows_step(NAN, model_with_grad(1.0), 1, 0)
    assert not getattr(raised.value, "agreed_by_all_ranks", False)  # the others did not see it


def test_with_local_steps_the_error_waits_for_the_strategy_and_every_later_step_is_skipped():
    guard = NanGuard(OnError.ERROR, 10, rank=1, shares_gradients=False)
    assert not guard.allows_step(NAN, model_with_grad(float("nan")), 1, 3)
    assert isinstance(guard.failure, TrainingFailedError)
    assert "at rank 1, epoch 1, step 3" in str(guard.failure)
    assert not guard.allows_step(FINE, model_with_grad(1.0), 1, 4)  # stopping


def health(loss_finite: bool, grads_finite: bool):
    from sparkdl.training.guards import StepHealth

    return StepHealth(loss_finite, grads_finite, float("nan"), rank=1, epoch=2, step=7)


@pytest.mark.parametrize(
    ("loss_ok", "grads_ok", "policy", "in_a_row", "shares", "action", "error", "agreed"),
    [
        (True, True, OnError.ERROR, 0, True, "apply", None, False),
        (True, True, OnError.SKIP, 5, False, "apply", None, False),
        # all-reduce: a non-finite average is seen by every rank at once
        (False, False, OnError.ERROR, 0, True, "stop", TrainingFailedError, True),
        (True, False, OnError.ERROR, 0, True, "stop", PeerStopped, True),
        # a non-finite loss with finite gradients is this rank's own
        (False, True, OnError.ERROR, 0, True, "stop", TrainingFailedError, False),
        # local steps: the error waits for the strategy's next sync point
        (False, False, OnError.ERROR, 0, False, "defer", TrainingFailedError, False),
        # skipping, within and beyond max_skips (3)
        (False, False, OnError.SKIP, 2, True, "skip", None, False),
        (False, False, OnError.SKIP, 3, True, "stop", TrainingFailedError, True),
        (False, True, OnError.SKIP, 3, False, "defer", TrainingFailedError, False),
    ],
)
def test_the_non_finite_decision_table(loss_ok, grads_ok, policy, in_a_row, shares, action, error, agreed):
    from sparkdl.training.guards import decide

    decision = decide(health(loss_ok, grads_ok), policy, 3, in_a_row, shares)
    assert decision.action.value == action
    assert (type(decision.error) if decision.error else None) is error
    assert decision.agreed is agreed
    if action == "stop" and policy is OnError.SKIP:
        assert "4 steps in a row" in decision.error.message and "max_nan_skips = 3" in decision.error.message


def test_the_gpu_check_skips_empty_shards_and_reads_sparse_gradients():
    """``largest_abs`` (the guard's check on a GPU, run here on CPU tensors): FSDP gives a
    rank empty shards of small parameters, which the infinity norm alone refuses."""
    from sparkdl.training.guards import largest_abs

    cpu = torch.device("cpu")
    empty = torch.zeros(0, 8)
    sparse = torch.sparse_coo_tensor([[0, 2]], [3.0, -7.0], (4,))
    assert largest_abs([empty, torch.zeros(0)], cpu).item() == 0.0
    assert largest_abs([empty, sparse, torch.tensor([1.0, -2.0])], cpu).item() == 7.0
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert not torch.isfinite(largest_abs([empty, torch.tensor([1.0, bad])], cpu))
        assert not torch.isfinite(largest_abs([torch.sparse_coo_tensor([[1]], [bad], (3,))], cpu))
    assert largest_abs([torch.tensor([3e38, -3e38])], cpu).item() == pytest.approx(3e38)  # no overflow
