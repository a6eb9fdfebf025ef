"""``training.compile`` (issue 55 item 4), in one process (no Spark): the model a strategy
builds is compiled in place (the compiled graph runs; names and weights stay the model's),
trains to eager's weights, its first step's seconds reach the history as ``compile_s``, and
the settings torch cannot honour are refused before any task. A backend that records the
graphs it is given stands in for inductor, whose compile takes tens of seconds on 2 CPUs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparkdl import ConfigError
from sparkdl.config import SparkDLConfig, Strategy
from sparkdl.strategies import check_settings, strategy_class
from sparkdl.training.checkpointing import Position
from sparkdl.training.hooks import EpochTally, FirstStepHook

GRAPHS: list[torch.fx.GraphModule] = []


@torch._dynamo.register_backend
def sparkdl_recording_backend(graph, example_inputs):
    """Runs the traced graph as it is, keeping it (proof that the compiled path ran)."""
    GRAPHS.append(graph)
    return graph.forward


def make_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def trained(compile_on: bool, steps: int = 5):
    config = SparkDLConfig().replace(compile=compile_on, compile_backend="sparkdl_recording_backend")
    module = strategy_class(Strategy.ALLREDUCE).build_module(make_mlp, config, torch.device("cpu"))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=generator), torch.randint(0, 3, (16,), generator=generator)
        loss = nn.functional.cross_entropy(module(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return module


def test_a_compiled_model_runs_its_compiled_graph_and_trains_to_eagers_weights():
    GRAPHS.clear()
    eager = trained(False)
    assert not GRAPHS
    torch._dynamo.reset()
    compiled = trained(True)
    assert GRAPHS, "the compiled graph never ran"
    assert list(compiled.state_dict()) == list(eager.state_dict())  # compiled in place: same names
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[name], value, atol=1e-6, rtol=1e-5)


def test_the_first_steps_seconds_reach_the_history_of_its_epoch_once():
    hook, history = FirstStepHook(), []
    for epoch in (1, 2):
        tally = EpochTally(epoch, 2, 0.0)
        for step in range(2):
            hook.before_step(Position(epoch, step, 2 * (epoch - 1) + step))
            hook.after_step(Position(epoch, step + 1, 2 * (epoch - 1) + step + 1), tally)
        history.append({"epoch": epoch})
        hook.after_epoch(Position(epoch + 1, 0, 2 * epoch), tally, history)
    assert "compile_s" in history[0] and history[0]["compile_s"] >= 0
    assert "compile_s" not in history[1]


def test_compile_is_refused_where_it_cannot_run_naming_what_can():
    with pytest.raises(ConfigError, match=r"compile = true with strategy 'fsdp': only 'allreduce'"):
        check_settings(SparkDLConfig().replace(strategy="fsdp", compile=True))
    with pytest.raises(ConfigError, match=r"compile_backend = 'inductr' is not a torch.compile backend"):
        check_settings(SparkDLConfig().replace(compile=True, compile_backend="inductr"))
    assert not SparkDLConfig().training.compile  # off by default
