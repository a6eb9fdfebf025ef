"""sparkdl.run on real Spark (local[2]): a user's own loop with ctx gives the reference
answer from a DataFrame with uneven partitions under all-reduce, fsdp, weight averaging
(every step) and the synchronous parameter server, and a lost worker mid-run resumes from
ctx's checkpoint with the same answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.reference import make_shards, make_tiny_net, max_abs_diff, reference_sgd
from tests.spark.test_fit import shards_dataframe

pytestmark = pytest.mark.spark

LR, MOMENTUM = 0.1, 0.9


def resumable_loop(ctx: Any, fail_marker: str = "", momentum: float = MOMENTUM) -> dict[str, torch.Tensor]:
    """A user's loop that checkpoints every 2 steps and resumes after a re-run; with
    ``fail_marker``, rank 1's process dies at step 3 of the first attempt."""
    import os

    torch.manual_seed(0)
    model = make_tiny_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    model, optimizer = ctx.prepare(model, optimizer)
    done = 0
    if ctx.config.reliability.checkpoint_dir:
        state = ctx.load_checkpoint()
        if state is not None:
            ctx.load_state_dict(model, state["model"])
            ctx.load_state_dict(optimizer, state["optimizer"])
            done = ctx.resumed_from
            ctx.report(resumed_from=done)
    for epoch in ctx.epochs:
        for batch in ctx.batches(epoch):
            step = ctx.global_step  # the same on every rank
            if step <= done:
                continue  # taken before the failure: its batch is only consumed
            if fail_marker and ctx.rank == 1 and step == 3 and not os.path.exists(fail_marker):
                open(fail_marker, "w").close()
                os._exit(3)  # the worker is lost: Spark re-runs the stage
            (x,) = batch.inputs.values()
            loss = F.cross_entropy(model(x), batch.label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ctx.report(loss=loss.item())
            if ctx.config.reliability.checkpoint_dir and step % 2 == 0:
                whole = {"model": ctx.state_dict(model), "optimizer": ctx.state_dict(optimizer)}
                ctx.save_checkpoint(whole, step)
    return ctx.state_dict(model)


def test_an_own_loop_on_uneven_partitions_is_single_process_sgd_and_logs_to_mlflow(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sparkdl

    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store opt-in
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    shards = make_shards([50, 21])
    result = sparkdl.run(
        resumable_loop,
        df=shards_dataframe(spark, shards),
        num_workers=2,
        batch_size=8,
        epochs=2,
        shuffle=False,
    )
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, False)
    assert max_abs_diff(result.value, expected) < 1e-5
    assert len(result.history) == 2 * 7 and all("loss" in h for h in result.history)
    assert [d["device"] for d in result.worker_devices] == ["cpu", "cpu"]
    # the run's settings and rank 0's reports, logged as a fit's are
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(result.mlflow_run_id)
    assert run.data.params["strategy"] == "allreduce" and run.data.params["batch_size"] == "8"
    logged = sorted((m.step, m.value) for m in client.get_metric_history(result.mlflow_run_id, "loss"))
    assert logged == [(h["step"], pytest.approx(h["loss"])) for h in result.history]


def test_a_lost_worker_resumes_from_the_loops_checkpoint(spark: Any, tmp_path: Path) -> None:
    import sparkdl

    shards = make_shards([50, 21])
    marker = tmp_path / "died"
    result = sparkdl.run(
        resumable_loop,
        str(marker),
        df=shards_dataframe(spark, shards),
        num_workers=2,
        batch_size=8,
        epochs=2,
        shuffle=False,
        checkpoint_dir=str(tmp_path / "checkpoints"),
    )
    assert marker.exists()  # rank 1 did die once
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, False)
    assert max_abs_diff(result.value, expected) < 1e-5
    assert result.history[0] == {"epoch": 1, "step": 0, "resumed_from": 2.0}
    assert [h["step"] for h in result.history[1:3]] == [3, 4]  # the global step, as counted before


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def test_an_own_loop_under_the_parameter_server_is_single_process_sgd(spark: Any) -> None:
    import sparkdl
    from sparkdl import ConfigError

    shards = make_shards([50, 21])
    df = shards_dataframe(spark, shards)
    with pytest.raises(ConfigError, match="pass model_fn="):
        sparkdl.run(resumable_loop, df=df, strategy="parameter_server")
    result = sparkdl.run(
        resumable_loop,
        df=df,
        num_workers=2,
        strategy="parameter_server",
        model_fn=make_tiny_net,
        optimizer_fn=_sgd,
        batch_size=8,
        epochs=2,
        shuffle=False,
    )
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, False)
    assert max_abs_diff(result.value, expected) < 1e-5


@pytest.mark.parametrize(
    ("strategy", "momentum", "settings"),
    [("weight_averaging", 0.0, {"sync_every": 1}), ("fsdp", MOMENTUM, {})],
    ids=["weight_averaging", "fsdp"],
)
def test_an_own_loop_under_weight_averaging_and_fsdp_is_single_process_sgd(
    spark: Any, strategy: str, momentum: float, settings: dict[str, Any]
) -> None:
    import sparkdl

    shards = make_shards([50, 21])
    result = sparkdl.run(
        resumable_loop, "", momentum, df=shards_dataframe(spark, shards), num_workers=2,
        strategy=strategy, batch_size=8, epochs=2, shuffle=False, **settings,
    )  # fmt: skip
    expected = reference_sgd(shards, 8, 2, 0, LR, momentum, False)
    assert max_abs_diff(result.value, expected) < 1e-5
