import re

import pytest
import torch

from sparkdl import ClusterConfigError
from sparkdl.config import Backend, UseGpu
from sparkdl.errors import BadDataError, TrainingFailedError
from sparkdl.spark.cluster import parse_seconds, wait_for_slots
from sparkdl.worker.device import choose_backend, choose_device


def test_device_comes_from_the_task_gpu_resources():
    assert choose_device(UseGpu.AUTO, ["1"], 2, 0) == torch.device("cuda", 1)
    assert choose_device(UseGpu.AUTO, [], 0, 0) == torch.device("cpu")
    assert choose_device(UseGpu.NO, ["0"], 1, 0) == torch.device("cpu")
    assert choose_device(UseGpu.AUTO, ["0"], 0, 0) == torch.device("cpu")  # given a GPU, no CUDA: warn


def test_the_training_stage_asks_for_one_gpu_per_task_only_when_executors_have_gpus():
    from sparkdl.spark.resources import decide_gpu_request

    assert decide_gpu_request(UseGpu.AUTO, 2, 0, 4, "spark://m:7077").gpus == 1
    assert decide_gpu_request(UseGpu.YES, 1, 0, 1, "spark://m:7077").cpus == 1
    assert decide_gpu_request(UseGpu.AUTO, 0, 0, 1, "local[2]").gpus == 0  # CPU cluster: CPU
    assert decide_gpu_request(UseGpu.NO, 8, 0, 1, "spark://m:7077").gpus == 0
    # every stage already holds a GPU: no profile of our own
    assert decide_gpu_request(UseGpu.YES, 1, 1, 1, "spark://m:7077").gpus == 0
    with pytest.raises(
        ClusterConfigError, match=r"use_gpu = true but the executors of local\[2\] have no GPUs"
    ):
        decide_gpu_request(UseGpu.YES, 0, 0, 1, "local[2]")


def test_required_gpu_missing_names_the_spark_setting():
    with pytest.raises(ClusterConfigError, match=r"rank 3: .*spark.executor.resource.gpu.amount"):
        choose_device(UseGpu.YES, [], 0, 3)
    with pytest.raises(ClusterConfigError, match=r"address '0' but this process sees 0 CUDA"):
        choose_device(UseGpu.YES, ["0"], 0, 0)  # required, and torch has no CUDA
    with pytest.raises(ClusterConfigError, match=r"address '2' but this process sees 1 CUDA"):
        choose_device(UseGpu.AUTO, ["2"], 1, 0)


def test_backend_follows_the_device():
    assert choose_backend(Backend.AUTO, torch.device("cpu")) == "gloo"
    assert choose_backend(Backend.AUTO, torch.device("cuda", 0)) == "nccl"
    with pytest.raises(ClusterConfigError, match="trains on CPU"):
        choose_backend(Backend.NCCL, torch.device("cpu"))


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_slot_check_waits_for_executors_then_succeeds():
    clock = FakeClock()
    answers = iter([0, 1, 2])
    assert wait_for_slots(lambda: next(answers), 2, 10, "spark://x", clock, clock.sleep) == 2
    assert clock.now == pytest.approx(1.0)


def test_slot_check_fails_at_its_deadline_with_the_fix():
    clock = FakeClock()
    with pytest.raises(
        ClusterConfigError,
        match=r"num_workers = 3 .* only 2 free task slot.*after waiting 5s.*Lower num_workers to 2",
    ):
        wait_for_slots(lambda: 2, 3, 5, "spark://x", clock, clock.sleep)
    assert clock.now == pytest.approx(5.0)


@pytest.mark.parametrize("master", ["local[2]", "local", "local[*]", "local[2,3]"])
def test_local_mode_fails_at_once_its_slots_never_grow(master):
    clock = FakeClock()
    with pytest.raises(
        ClusterConfigError,
        match=rf"num_workers = 3 but local mode \({re.escape(master)}\) has only 2 free task slot\(s\), and "
        r"its slots never grow; .* Lower num_workers to 2, or start the session with local\[3\]",
    ):
        wait_for_slots(lambda: 2, 3, 30, master, clock, clock.sleep)
    assert clock.now == 0.0  # no wait at all
    answers = iter([0, 4])  # local-cluster's executors register over time: it waits
    assert wait_for_slots(lambda: next(answers), 3, 30, "local-cluster[2,2,1024]", clock, clock.sleep) == 4


def test_spark_durations_parse():
    assert parse_seconds("60s") == 60 and parse_seconds("365d") == 365 * 86400
    assert parse_seconds("2min") == 120 and parse_seconds("1500ms") == 1.5


def test_errors_pickle_with_their_fields():
    import pickle

    err = pickle.loads(pickle.dumps(BadDataError("bad", column="x", bad_rows=3)))
    assert (type(err), str(err), err.column, err.bad_rows) == (BadDataError, "bad", "x", 3)
    failed = pickle.loads(pickle.dumps(TrainingFailedError("t", {1: "boom"})))
    assert failed.causes == {1: "boom"}


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_named_optimizers_keep_pytorchs_default_kernels_on_cpu(name):
    from sparkdl.config import OptimizerConfig, OptimizerName
    from sparkdl.training.factory import build_optimizer

    params = list(torch.nn.Linear(4, 3).parameters())
    optimizer = build_optimizer(params, None, OptimizerConfig(optimizer=OptimizerName(name)))
    assert optimizer.defaults["fused"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_named_optimizers_fuse_on_a_gpu_and_step_as_on_the_cpu(name):
    """On CUDA adam and adamw take PyTorch's fused kernel (sgd does not: see factory.py);
    three steps land where the CPU's default kernels do (float32 rounding apart)."""
    from sparkdl.config import OptimizerConfig, OptimizerName
    from sparkdl.training.factory import build_optimizer

    config = OptimizerConfig(optimizer=OptimizerName(name), lr=0.05, momentum=0.9, weight_decay=0.01)
    torch.manual_seed(0)
    cpu = torch.nn.Linear(16, 8)
    gpu = torch.nn.Linear(16, 8).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(32, 16)
    models = {"cpu": (cpu, x), "cuda": (gpu, x.cuda())}
    optimizers = {k: build_optimizer(m.parameters(), None, config) for k, (m, _) in models.items()}
    assert optimizers["cuda"].defaults["fused"] is (None if name == "sgd" else True)
    assert optimizers["cpu"].defaults["fused"] is None
    for _ in range(3):
        for key, (model, inputs) in models.items():
            optimizers[key].zero_grad()
            model(inputs).square().mean().backward()
            optimizers[key].step()
    for name_, value in cpu.state_dict().items():
        torch.testing.assert_close(gpu.state_dict()[name_].cpu(), value, rtol=1e-5, atol=1e-6)
