"""Preflight on the driver: the model, the loss and a few rows, checked once, in the user's terms.

Pure torch (and, for the environment check's decision and its shipped function, the
standard library): no Spark.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from sparkdl.data.tensors import Batch
from sparkdl.errors import ConfigError, ModelMismatchError
from sparkdl.spark.environment import (
    SHIPPED_PROBE,
    Interpreter,
    driver_interpreter,
    environment_problems,
    mismatch_message,
)
from sparkdl.training.preflight import preflight

FEATURES = "the feature columns ['features']"
LABEL = "the label column 'y'"


def batch(
    rows: int = 8, width: int = 6, label: torch.Tensor | None = None, x: torch.Tensor | None = None
) -> Batch:
    """Features and a float32 label, as the feed makes them for a real-valued loss."""
    if x is None:
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(0))
    y = label if label is not None else (torch.arange(rows) % 2).float()
    return Batch({"features": x}, y)


def mismatch(model_fn, loss, data, **kwargs) -> str:
    with pytest.raises(ModelMismatchError) as caught:
        preflight(model_fn, None, loss, data, FEATURES, LABEL, **kwargs)
    return str(caught.value)


# --------------------------------------------------------------------------- the features


def test_six_features_into_an_eight_input_model_names_both_widths_and_the_fix():
    message = mismatch(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), "mse", batch())

    assert message.startswith(f"{FEATURES} give 6 values per row; the model's first layer expects 8 ")
    assert "Linear(in_features=8, out_features=16" in message
    assert "take 6 inputs or change feature_cols" in message


def test_a_layer_inside_the_model_that_does_not_fit_the_one_before_it_is_named():
    message = mismatch(
        lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(12, 2)), "cross_entropy", batch()
    )

    assert message.startswith("layer '2' (Linear(in_features=12, out_features=2")
    assert "the layers before it give 16" in message


def test_a_conv2d_model_fed_flat_features_is_told_how_to_reshape_them():
    model_fn = lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.LazyLinear(10))  # noqa: E731
    message = mismatch(model_fn, "cross_entropy", batch(width=784, label=torch.zeros(8).long()))

    assert f"{FEATURES} give 784 values per row, as a flat (N, 784) batch" in message
    assert "Conv2d(1, 4, kernel_size=(3, 3)" in message and "expects (N, 1, H, W)" in message
    assert "nn.Unflatten(1, (1, 28, 28))" in message


def test_flat_features_into_a_conv1d_are_caught_even_when_torch_would_read_them_unbatched():
    # 8 rows into Conv1d(8, ...): torch takes the (8, 12) batch as ONE sample of 8 channels
    # and does not fail; the model's output would then have no row per input row.
    model_fn = lambda: nn.Sequential(nn.Conv1d(8, 4, 3), nn.Flatten(0), nn.LazyLinear(2))  # noqa: E731
    message = mismatch(model_fn, "mse", batch(rows=8, width=12))

    assert "as a flat (N, 12) batch" in message and "expects (N, 8, L)" in message


def test_an_embedding_model_fed_float_features_is_told_to_convert_them_to_ids():
    model_fn = lambda: nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(24, 2))  # noqa: E731
    message = mismatch(model_fn, "cross_entropy", batch())

    assert message.startswith(f"{FEATURES} reach the model as float32 values")
    assert "Embedding(10, 4) takes integer ids" in message and "x.long()" in message


def test_a_float64_model_is_told_the_feed_gives_float32():
    message = mismatch(lambda: nn.Linear(6, 2).double(), "cross_entropy", batch())

    assert "holds float64 weights but gets float32 inputs; the feed gives float32 features" in message


# --------------------------------------------------------------------------- output vs. label


@pytest.mark.parametrize("rows", [8, 2])
def test_an_integer_label_with_mse_and_a_two_output_model_suggests_cross_entropy(rows):
    # With 2 rows torch would broadcast (2, 2) against (2,) and train on nonsense with a
    # warning: preflight compares the shapes itself instead of waiting for torch to fail.
    message = mismatch(lambda: nn.Linear(6, 2), "mse", batch(rows=rows), label_integer=True)

    assert message == (
        f"mse needs a label of shape (N, 2) for a 2-output model; {LABEL} is one integer per row; "
        "use loss_fn='cross_entropy' or one-hot the label"
    )


def test_whole_number_labels_count_as_integers_when_the_column_type_is_not_given():
    assert "one integer per row" in mismatch(lambda: nn.Linear(6, 2), "bce_with_logits", batch())


def test_a_real_label_with_a_two_output_model_asks_for_one_output():
    message = mismatch(lambda: nn.Linear(6, 2), "mse", batch(label=torch.rand(8)), label_integer=False)

    assert f"{LABEL} is one number per row; make the model's last layer output 1 value" in message


def test_a_one_output_model_with_cross_entropy_needs_one_score_per_class():
    model_fn = lambda: nn.Sequential(nn.Linear(6, 1), nn.Flatten(0))  # noqa: E731
    message = mismatch(model_fn, "cross_entropy", batch(label=torch.zeros(8).long()))

    assert "cross_entropy needs the model to output one score per class, (N, C)" in message
    assert "the model outputs (N,)" in message and "bce_with_logits" in message


def test_class_labels_beyond_the_model_outputs_are_left_to_the_training_loop():
    labels = torch.tensor([0, 1, 5, 7, 1, 0, 1, 0])

    report = preflight(lambda: nn.Linear(6, 2), None, "cross_entropy", batch(label=labels), FEATURES, LABEL)

    assert report.output_shape == (2,) and not report.skipped


def mse_broadcasting(output, target, weight=None):
    """A hand-written regression loss: (N, 1) - (N,) is (N, N), every output against every label."""
    return ((output - target) ** 2).mean()


def mse_viewed(output, target, weight=None):
    return ((output - target.view_as(output)) ** 2).mean()


def test_a_callable_loss_that_broadcasts_a_one_column_output_against_the_label_is_refused():
    message = mismatch(lambda: nn.Linear(6, 1), mse_broadcasting, batch())
    assert message.startswith(
        "loss mse_broadcasting gives a different value for the model's output (8, 1) float32 and the "
        "target (8,) float32 from the label column 'y' than for the same target shaped like the output: "
        "it broadcasts them to (8, 8)"
    ), message
    assert "view the target like the output (target.view_as(output))" in message
    # the same model with a loss that views the target, or the named loss (which views it itself)
    assert preflight(lambda: nn.Linear(6, 1), None, mse_viewed, batch(), FEATURES, LABEL).output_shape == (1,)
    assert preflight(lambda: nn.Linear(6, 1), None, "mse", batch(), FEATURES, LABEL).output_shape == (1,)


def test_a_model_returning_a_tuple_is_told_to_return_one_tensor():
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 1), nn.Linear(6, 1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.a(x), self.b(x)

    assert "the model returns a tuple, not a tensor" in mismatch(TwoHeads, "mse", batch())


# --------------------------------------------------------------------------- the loss


def test_a_custom_loss_that_raises_is_wrapped_with_its_type_and_the_shapes():
    def strict_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise KeyError("no such head")

    message = mismatch(lambda: nn.Linear(6, 2), strict_loss, batch())

    assert "strict_loss raised KeyError: 'no such head'" in message
    assert (
        "the model's output (8, 2) float32 and the target (8,) float32 from the label column 'y'" in message
    )


def test_a_loss_per_row_instead_of_its_mean_is_refused():
    message = mismatch(lambda: nn.Linear(6, 1), lambda o, t: (o[:, 0] - t) ** 2, batch())

    assert "returned (8,) float32" in message and ".mean()" in message


def test_a_model_that_detaches_its_output_has_no_gradient():
    class Detached(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).detach()

    assert "has no gradient" in mismatch(lambda: Detached(6, 1), "mse", batch())


# --------------------------------------------------------------------------- what passes


def test_a_fitting_model_passes_and_reports_its_output_shape_and_parameter_count():
    def model_fn() -> nn.Module:
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        model[0].requires_grad_(False)
        return model

    report = preflight(model_fn, None, "cross_entropy", batch(label=torch.arange(8) % 3), FEATURES, LABEL)

    assert (report.rows, report.input_shapes, report.output_shape) == (8, {"features": (6,)}, (3,))
    assert report.parameters == 6 * 16 + 16 + 16 * 3 + 3
    assert report.trainable_parameters == 16 * 3 + 3
    assert "inputs (N, 6) -> output (N, 3), 163 parameters (51 trainable)" in report.summary()


def test_non_finite_outputs_are_not_a_mismatch():
    data = batch()
    data.inputs["features"][0, 0] = float("nan")

    report = preflight(lambda: nn.Linear(6, 1), None, "mse", data, FEATURES, LABEL)

    assert report.output_shape == (1,) and torch.isnan(torch.tensor(report.loss))


def test_preflight_leaves_the_drivers_random_state_alone():
    before = torch.get_rng_state()

    preflight(lambda: nn.Sequential(nn.Linear(6, 1), nn.Dropout(0.5)), None, "mse", batch(), FEATURES, LABEL)

    assert torch.equal(torch.get_rng_state(), before)


def test_the_checked_model_is_freed_when_preflight_returns_without_a_garbage_collection():
    # the driver collects only after a large model (a full collection costs ~0.2 s there):
    # preflight's own hooks must leave no reference cycle that keeps the model alive
    built: list[weakref.ref[nn.Module]] = []

    def model_fn() -> nn.Module:
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        built.extend(weakref.ref(layer) for layer in model.modules())
        return model

    sgd([nn.Parameter(torch.zeros(1))])  # a process's first optimizer imports torch's
    # compiler stack, whose import frames hold that first caller's frame in a cycle (once)
    gc.disable()
    try:
        preflight(model_fn, sgd, "cross_entropy", batch(label=torch.arange(8) % 3), FEATURES, LABEL)
        assert len(built) == 4 and [ref() for ref in built] == [None] * 4
    finally:
        gc.enable()


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def test_optimizer_fn_must_return_an_optimizer():
    with pytest.raises(ConfigError, match="optimizer_fn returned list"):
        preflight(lambda: nn.Linear(6, 1), lambda params: list(params), "mse", batch(), FEATURES, LABEL)


def test_unrecognised_failures_only_skip_the_check_when_not_strict():
    class NeedsCuda(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("Found no NVIDIA driver on your system")

    strict = mismatch(lambda: NeedsCuda(6, 1), "mse", batch())
    lenient = preflight(lambda: NeedsCuda(6, 1), None, "mse", batch(), FEATURES, LABEL, strict=False)

    assert "forward failed on 8 rows of the feature columns ['features']" in strict
    assert "RuntimeError: Found no NVIDIA driver" in strict and "in layer ''" in strict
    assert lenient.skipped == strict and lenient.summary().startswith("preflight skipped")
    # a recognised mismatch is an error either way
    assert "expects 8" in mismatch(lambda: nn.Linear(8, 1), "mse", batch(), strict=False)


# --------------------------------------------------------------------------- executors' Python

DRIVER = Interpreter("/work/.venv/bin/python", "3.11.7", "2.5.1+cpu", "", "0.1.0", "")


def test_an_executor_without_sparkdl_is_named_with_pyspark_python_and_both_interpreters():
    executor = Interpreter(
        "/usr/bin/python3", "3.11.7", "2.5.1+cu121", "", "", "ModuleNotFoundError: No module named 'sparkdl'"
    )

    problems = environment_problems(DRIVER, executor)
    message = mismatch_message(DRIVER, executor, problems, "python3")

    assert problems == ["sparkdl cannot be imported (ModuleNotFoundError: No module named 'sparkdl')"]
    assert message.startswith("executors run /usr/bin/python3 (3.11.7), where sparkdl cannot be imported")
    assert (
        "set PYSPARK_PYTHON (now 'python3')" in message
        and "the driver runs /work/.venv/bin/python" in message
    )


def test_python_minor_and_torch_versions_must_match_but_builds_may_differ():
    older = Interpreter("/opt/py", "3.10.12", "2.4.0", "", "0.1.0", "")
    same = Interpreter("/opt/py", "3.11.2", "2.5.0+cu121", "", "0.1.0", "")

    assert [p.split()[0] for p in environment_problems(DRIVER, older)] == ["Python", "torch"]
    assert environment_problems(DRIVER, same) == []


def test_the_shipped_probe_runs_where_sparkdl_cannot_be_imported():
    from pyspark import cloudpickle

    code = (
        "import pickle, sys; sys.modules['sparkdl'] = None; "
        "probe = pickle.loads(sys.stdin.buffer.read()); print(probe(0))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=cloudpickle.dumps(SHIPPED_PROBE),
        capture_output=True,
        timeout=120,
    )

    assert done.returncode == 0, done.stderr.decode()[-2000:]
    facts = Interpreter.from_json(done.stdout.decode().strip())
    assert facts.sparkdl == "" and facts.sparkdl_error.startswith("ModuleNotFoundError")
    assert "'sparkdl" in facts.sparkdl_error
    assert facts.executable == sys.executable and facts.torch == torch.__version__


def test_the_driver_describes_itself_as_an_executor_would():
    me = driver_interpreter()

    assert me.executable == sys.executable and me.torch == torch.__version__ and me.sparkdl
    assert json.loads(json.dumps(me.__dict__)) == me.__dict__
