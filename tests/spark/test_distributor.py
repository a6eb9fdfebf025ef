"""sparkdl.TorchDistributor on real Spark (local[2], one barrier task per process): code
written for PySpark's distributor runs unchanged, and gives what PySpark's gives; failures
come back typed, fast, with the rank; a killed process makes Spark re-run the stage."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.spark


def train(learning_rate: float, steps: int = 5) -> Any:
    """PySpark's docstring example, filled in: DDP on gloo (CPU), returns the model."""
    import torch
    import torch.distributed
    from torch.nn.parallel import DistributedDataParallel

    torch.distributed.init_process_group(backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=learning_rate)
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=generator)
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.distributed.destroy_process_group()
    return model


def train_state(learning_rate: float) -> dict[str, torch.Tensor]:
    return train(learning_rate).state_dict()


def fails_on_rank_1() -> None:
    import os
    import time

    if os.environ["RANK"] == "1":
        raise ValueError("bad batch on rank 1")
    time.sleep(120)  # rank 0 would wait this long without the failure board


def killed_on_first_attempt(marker: str) -> dict[str, torch.Tensor]:
    import os
    import signal

    if os.environ["RANK"] == "1" and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # a lost process: Spark must re-run the stage
    return train_state(0.1)


def test_pyspark_docstring_function_gives_what_pyspark_gives(spark: Any) -> None:
    from pyspark.ml.torch.distributor import TorchDistributor as PySparkDistributor

    from sparkdl import TorchDistributor

    ours = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 0.1)
    # PySpark's children cannot import this test module: send its functions by value
    from pyspark import cloudpickle  # PySpark pickles with its own copy

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        theirs = PySparkDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 0.1)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert isinstance(ours, torch.nn.Linear)
    for name, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], value, rtol=0, atol=0)
    assert not torch.equal(ours.weight, torch.nn.Linear(4, 2).weight)  # it trained


def test_a_script_sees_torchrun_environment(spark: Any, tmp_path: Path) -> None:
    from sparkdl import TorchDistributor

    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, os, sys
            import torch.distributed as dist
            dist.init_process_group("gloo")
            names = ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                     "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RUN_ID"]
            seen = {n: os.environ.get(n) for n in names}
            seen["argv"] = sys.argv[1:]
            seen["world"] = dist.get_world_size()
            dist.destroy_process_group()
            out = sys.argv[1].split("=", 1)[1]
            with open(os.path.join(out, f"rank{seen['RANK']}.json"), "w") as f:
                json.dump(seen, f)
            print("trained rank", seen["RANK"])
            """
        )
    )
    result = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        str(script), f"--out={tmp_path}", "--lr=0.1"
    )
    assert result is None
    import json

    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["RANK"] for s in seen] == ["0", "1"]
    assert {s["WORLD_SIZE"] for s in seen} == {"2"} and {s["world"] for s in seen} == {2}
    assert {s["LOCAL_RANK"] for s in seen} == {"0"} and {s["LOCAL_WORLD_SIZE"] for s in seen} == {"1"}
    assert {s["CUDA_VISIBLE_DEVICES"] for s in seen} == {""}  # use_gpu=False, as PySpark's
    assert len({(s["MASTER_ADDR"], s["MASTER_PORT"], s["TORCHELASTIC_RUN_ID"]) for s in seen}) == 1
    assert seen[0]["argv"] == [f"--out={tmp_path}", "--lr=0.1"]


def test_an_exception_stops_every_rank_and_comes_back_with_its_rank(spark: Any) -> None:
    from sparkdl import TorchDistributor, TrainFunctionError

    started = time.monotonic()
    with pytest.raises(TrainFunctionError) as caught:
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(fails_on_rank_1)
    elapsed = time.monotonic() - started
    error = caught.value
    assert error.rank == 1 and error.python_type == "ValueError"
    assert "bad batch on rank 1" in error.message and "fails_on_rank_1" in error.message
    assert "Traceback" in error.message
    assert elapsed < 60, f"rank 0 was not stopped: {elapsed:.0f}s"


def test_a_script_that_exits_non_zero_shows_its_last_lines(spark: Any, tmp_path: Path) -> None:
    from sparkdl import TorchDistributor, TrainFunctionError

    script = tmp_path / "broken.py"
    script.write_text(
        "import sys\nprint('loading data', file=sys.stderr)\nsys.exit('no such table: events')\n"
    )
    with pytest.raises(TrainFunctionError) as caught:
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(str(script))
    assert caught.value.exit_code == 1
    assert "no such table: events" in caught.value.output_tail
    assert "loading data" in caught.value.message


def test_a_killed_process_makes_spark_rerun_the_stage(spark: Any, tmp_path: Path) -> None:
    from sparkdl import TorchDistributor

    marker = tmp_path / "killed-once"
    result = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        killed_on_first_attempt, str(marker)
    )
    assert marker.exists()
    # a state dict comes back as tensors, through the driver's weights server
    assert sorted(result) == ["bias", "weight"] and all(isinstance(v, torch.Tensor) for v in result.values())
    assert result["weight"].shape == (2, 4) and result["weight"].device.type == "cpu"


def test_what_cannot_be_pickled_is_named_before_any_task(spark: Any) -> None:
    import threading

    from sparkdl import ConfigError, TorchDistributor

    lock = threading.Lock()

    def holds_a_lock() -> None:
        with lock:
            pass

    with pytest.raises(ConfigError, match="holds_a_lock"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(holds_a_lock)
    with pytest.raises(ConfigError, match="command-line arguments"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run("train.py", lr=0.1)


def lightning_train(epochs: int) -> dict[str, Any]:
    """PySpark's docstring Lightning example on CPU: devices=1, num_nodes=num_processes, ddp."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    x = torch.randn(256, 4)
    data = TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))
    model = Regression()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        strategy="ddp",
        max_epochs=epochs,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=32))
    return {
        "world_size": trainer.world_size,
        "global_rank": trainer.global_rank,
        "loss": float(trainer.callback_metrics["train_loss"]),
        "weight": model.layer.weight.detach().clone(),
    }


def test_a_lightning_trainer_runs_unchanged_inside_run(spark: Any) -> None:
    pytest.importorskip("lightning")
    from sparkdl import TorchDistributor

    result = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(lightning_train, 20)
    assert result["world_size"] == 2 and result["global_rank"] == 0
    assert result["loss"] < 0.05, result  # it learned y = x @ (1, -2, 0.5, 3)
    torch.testing.assert_close(result["weight"], torch.tensor([[1.0, -2.0, 0.5, 3.0]]), atol=0.1, rtol=0)


def test_pysparks_gpu_fallback_runs_unchanged(spark: Any) -> None:
    """Notebook code written for PySpark's distributor catches RuntimeError where GPUs are
    missing and runs on the CPU instead (issue 54); sparkdl's errors for a missing GPU and
    for the code's own failure are RuntimeErrors too, as PySpark's are."""
    from sparkdl import ClusterConfigError, TorchDistributor

    try:
        result = TorchDistributor(num_processes=1, local_mode=True, use_gpu=True).run(train, 1e-3)
        fell_back = False
    except RuntimeError as exc:
        assert isinstance(exc, ClusterConfigError) and "GPU" in str(exc)
        result = TorchDistributor(num_processes=1, local_mode=True, use_gpu=False).run(train, 1e-3)
        fell_back = True
    assert fell_back == (not torch.cuda.is_available())
    assert result is not None
    with pytest.raises(RuntimeError, match="bad batch on rank 1"):
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(fails_on_rank_1)
