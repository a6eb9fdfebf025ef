"""Preflight: one forward, loss and backward of the user's model on a few rows, before training.

A model whose first layer does not fit the features, or a loss whose target does not fit the
model's output, fails on every worker at the first step; Spark then re-runs the stage before
giving up with torch's wording. Preflight builds the model once on the driver's CPU, runs a few
rows (decoded by the feed's own code) through it, the loss and one backward, and says what does
not fit in the user's terms: the columns, the widths, the layer, and what to change.

The common cases are recognised from the model and the shapes (the layer that was running and
the input it expects, the output and label widths, the label kind of the loss), never from the
wording of torch's messages; anything else is reported with its type and the shapes and dtypes
involved. Values are not judged: a NaN output is not a mismatch. Pure torch: no Spark.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sparkdl.config import OptimizerConfig
from sparkdl.data.columns import LabelKind
from sparkdl.data.tensors import Batch, call_model
from sparkdl.errors import ModelMismatchError, SparkDLError
from sparkdl.training.factory import ModelFn, OptimizerFn, build_model, build_optimizer
from sparkdl.training.layer_checks import (
    CONV_LAYERS,
    Sample,
    Trace,
    describe,
    dtype_text,
    layer_problem,
    shape_text,
)
from sparkdl.training.losses import LossFn, resolve_loss

log = logging.getLogger(__name__)

_TEXT_LIMIT = 500


@dataclass(frozen=True)
class PreflightReport:
    """What one step on the preflight batch showed.

    Attributes:
        rows: rows in the preflight batch; input_shapes: one row of each input.
        output_shape: one row of the model's output (``()`` when the check was skipped).
        parameters: parameter values in the model; trainable_parameters: those with requires_grad.
        loss: the loss on the batch (may be NaN: values are not checked; class ids the model
            has no output for count as class 0).
        seconds: time taken; skipped: why the check could not finish ("" when it did).
    """

    rows: int
    input_shapes: dict[str, tuple[int, ...]]
    output_shape: tuple[int, ...] = ()
    parameters: int = 0
    trainable_parameters: int = 0
    loss: float = math.nan
    seconds: float = 0.0
    skipped: str = ""

    def summary(self) -> str:
        """One line for the driver's log."""
        if self.skipped:
            return f"preflight skipped: {self.skipped}"
        return (
            f"preflight on {self.rows} rows: inputs {_shapes_text(self.input_shapes)} -> output "
            f"{shape_text(self.output_shape)}, {self.parameters:,} parameters "
            f"({self.trainable_parameters:,} trainable), loss {self.loss:.4g}, {self.seconds:.2f}s"
        )


class _Unrecognised(Exception):
    """A failure preflight has no diagnosis for: an error when strict, else a skipped check."""


def preflight(
    model_fn: ModelFn,
    optimizer_fn: OptimizerFn | None,
    loss: str | LossFn,
    batch: Batch,
    feature_desc: str,
    label_desc: str,
    *,
    keyword: bool = False,
    label_integer: bool | None = None,
    strict: bool = True,
    model_check: Callable[[nn.Module], None] | None = None,
) -> PreflightReport:
    """Build the model, run forward, the loss and one backward on ``batch``, on CPU.

    The driver's random state is left as it was, and the model is thrown away.

    Args:
        model_fn, optimizer_fn, loss: as given to the estimator.
        batch: a few rows, as the feed makes them.
        feature_desc: the inputs in the user's terms, e.g. "the feature columns ['x']".
        label_desc: the label in the user's terms, e.g. "the label column 'y'".
        keyword: the model takes its inputs by name (``model(**inputs)``).
        label_integer: the label column holds integers (None: judged from the values).
        strict: raise on failures preflight does not recognise; when False (e.g. a model
            meant for GPUs checked on a driver without one) they only skip the check.
        model_check: the strategy's rules for the model (``SyncStrategy.check_model``),
            raising ConfigError for a model it cannot train.

    Returns:
        the report: output shape, parameter counts, loss.

    Raises:
        ModelMismatchError: the model, the loss and the data do not fit together.
        ConfigError: model_fn or optimizer_fn returned the wrong kind of object.
    """
    started = time.perf_counter()
    y = batch.label if batch.label is not None else torch.zeros(len(batch))
    integer = _is_integral(y) if label_integer is None else label_integer
    sample = Sample(batch, keyword, y, feature_desc, label_desc, integer)
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            report = _run(model_fn, optimizer_fn, loss, sample, model_check)
    except _Unrecognised as exc:
        if strict:
            raise ModelMismatchError(str(exc)) from exc.__cause__
        log.warning("preflight could not check the model on the driver: %s", exc)
        return PreflightReport(len(batch), batch.shapes(), skipped=str(exc))
    return dataclasses.replace(report, seconds=time.perf_counter() - started)


def _run(
    model_fn: ModelFn,
    optimizer_fn: OptimizerFn | None,
    loss: str | LossFn,
    sample: Sample,
    model_check: Callable[[nn.Module], None] | None = None,
) -> PreflightReport:
    loss_fn, label_kind = resolve_loss(loss)
    try:
        module = build_model(model_fn).to("cpu")
        # torch.compile'd: check the model itself, without compiling it for the driver's CPU
        module = getattr(module, "_orig_mod", module)
    except SparkDLError:
        raise
    except Exception as exc:  # may work on executors (their files, their GPUs): no verdict
        raise _Unrecognised(f"model_fn raised {_error_text(exc)} on the driver") from exc
    if model_check is not None:
        model_check(module)  # the strategy's rules (a pipeline's cut) before anything runs
    output = _forward(module, sample)
    problem = _output_problem(output, loss, label_kind, sample)
    if problem:
        raise ModelMismatchError(problem)
    if label_kind is LabelKind.CLASS_INDEX and isinstance(loss, str):
        # Labels the model has no output for are the training loop's to report (with their
        # count, on every rank): here they only stand in as class 0.
        known = (sample.y >= 0) & (sample.y < output.shape[-1])
        sample = dataclasses.replace(sample, y=torch.where(known, sample.y, 0))
    value = _loss_and_backward(module, loss_fn, _loss_name(loss), output, sample)
    if not isinstance(loss, str):  # the named losses view the label like the output themselves
        _refuse_broadcast(loss_fn, _loss_name(loss), output, sample, value)
    if optimizer_fn is not None:
        build_optimizer(module.parameters(), optimizer_fn, OptimizerConfig())
    module.zero_grad(set_to_none=True)  # the gradients are as large as the model: free them now
    parameters = list(module.parameters())
    return PreflightReport(
        rows=len(sample.batch),
        input_shapes=sample.batch.shapes(),
        output_shape=tuple(output.shape[1:]),
        parameters=sum(p.numel() for p in parameters),
        trainable_parameters=sum(p.numel() for p in parameters if p.requires_grad),
        loss=float(value.detach().float().mean()),
    )


def _forward(module: nn.Module, sample: Sample) -> Any:
    """The model's output; a failure is diagnosed from the layer that was running."""
    trace = Trace(module)
    try:
        output = call_model(module, sample.batch, sample.keyword)
    except Exception as exc:
        call = trace.running
        problem = layer_problem(call, sample) if call is not None else None
        if problem:
            raise ModelMismatchError(problem) from exc
        where = ""
        if call is not None:
            where = f" in layer {call.name!r} ({call.module!r}), given {describe(call.input)}"
        elif trace.last_done is not None:
            where = f" after layer {trace.last_done[0]!r} returned {describe(trace.last_done[1])}"
        raise _Unrecognised(
            f"the model's forward failed on {len(sample.batch)} rows of {sample.features} (inputs "
            f"{_inputs_text(sample.batch)}, label {describe(sample.y)} from {sample.label}): "
            f"{_error_text(exc)}{where}"
        ) from exc
    finally:
        trace.remove()
    # A flat (N, F) batch is a valid *unbatched* input of a Conv1d or an RNN: torch may not
    # fail, but it would read the rows as channels or time steps.
    first = trace.first
    if first is not None and isinstance(first.module, (*CONV_LAYERS, nn.RNNBase)):
        problem = layer_problem(first, sample)
        if problem:
            raise ModelMismatchError(problem)
    return output


def _loss_and_backward(
    module: nn.Module, loss_fn: LossFn, name: str, output: torch.Tensor, sample: Sample
) -> torch.Tensor:
    shapes = f"the model's output {describe(output)} and the target {describe(sample.y)} from {sample.label}"
    try:
        value = loss_fn(output, sample.y, sample.batch.weight)
    except Exception as exc:
        raise _Unrecognised(f"loss {name} raised {_error_text(exc)} on {shapes}") from exc
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        got = describe(value)
        raise ModelMismatchError(
            f"loss {name} returned {got} on {shapes}; it must return the mean loss of the batch, "
            "one value (e.g. end it with .mean())"
        )
    if not any(p.requires_grad for p in module.parameters()):
        raise ModelMismatchError(
            "the model has no trainable parameters (none has requires_grad=True): nothing to "
            "train; unfreeze at least one layer in model_fn"
        )
    if not value.requires_grad:
        raise ModelMismatchError(
            f"loss {name} does not depend on the model's trainable parameters (it has no gradient); "
            "forward must not detach its output or end in argmax, round or .item()"
        )
    try:
        value.backward()
    except Exception as exc:
        raise _Unrecognised(f"backward failed: {_error_text(exc)} (loss {name} on {shapes})") from exc
    return value


def _refuse_broadcast(
    loss_fn: LossFn, name: str, output: torch.Tensor, sample: Sample, value: torch.Tensor
) -> None:
    """An output of (N, 1) against a label of (N,) (or the other way round) broadcasts to
    (N, N) in ``output - target``: the loss is then of every output against every label,
    silently. A callable loss must give the same value (``value``, already computed) when
    handed the label shaped like the output, or it broadcast."""
    y = sample.y
    if y.shape == output.shape or y.numel() != output.numel() or len(sample.batch) < 2:
        return
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own broadcasting warning: we say it better
            viewed = loss_fn(output, y.view_as(output), sample.batch.weight)
    except Exception:
        return  # it does not take the label in the output's shape: it reshapes it itself
    if (
        isinstance(viewed, torch.Tensor)
        and viewed.numel() == 1
        and torch.isclose(
            viewed.detach().float(), value.detach().float(), rtol=1e-4, atol=1e-6, equal_nan=True
        )
    ):
        return
    try:
        broadcast = f"it broadcasts them to {tuple(torch.broadcast_shapes(output.shape, y.shape))}"
    except RuntimeError:
        broadcast = "it pairs them differently"
    raise ModelMismatchError(
        f"loss {name} gives a different value for the model's output {describe(output)} and "
        f"the target {describe(y)} from {sample.label} than for the same target shaped like the "
        f"output: {broadcast}, so outputs are compared with other rows' labels; in the loss, view "
        "the target like the output (target.view_as(output)), or squeeze the model's last dimension"
    )


# --------------------------------------------------------------------------- the model's layers


def _output_problem(output: Any, loss: str | LossFn, kind: LabelKind, sample: Sample) -> str | None:
    """Why the model's output cannot work with the loss and the label; None if it can."""
    rows = len(sample.batch)
    if not isinstance(output, torch.Tensor):
        return (
            f"the model returns a {type(output).__name__}, not a tensor; the loss and predictions need "
            "forward to return one tensor of shape (N, ...): return the logits (e.g. output[0])"
        )
    if output.ndim == 0 or output.shape[0] != rows:
        return (
            f"the model returns {describe(output)} for a batch of {rows} rows; its first dimension "
            "must be the batch (one output row per input row): check reshapes in forward such as "
            "view(-1, ...) or a flatten over the whole batch"
        )
    if not (output.is_floating_point() or output.is_complex()):
        return (
            f"the model returns {dtype_text(output)} values; training needs floating-point outputs "
            "(forward must not end in argmax, round or .long())"
        )
    if not isinstance(loss, str):
        return None  # a callable loss decides for itself what it accepts
    if kind is LabelKind.CLASS_INDEX:
        if sample.y.ndim > 1:
            return _per_position_problem(output, loss, sample)
        if output.ndim == 2:
            return None
        other = ", or use loss_fn='bce_with_logits' for one logit per row" if output.ndim == 1 else ""
        return (
            f"{loss} needs the model to output one score per class, (N, C), for {sample.label} (one "
            f"class id per row); the model outputs {shape_text(output.shape[1:])}: make its last layer "
            f"output C values (C = the number of classes){other}"
        )
    y = sample.y
    if y.shape == output.shape or y.numel() == output.numel():
        return None  # the named losses view [N] targets as [N, 1] outputs
    outputs, width = math.prod(output.shape[1:]), math.prod(y.shape[1:])
    if y.ndim > 1:
        kind_text = f"{width} values per row, {shape_text(y.shape[1:])}"
        fix = f"make the model's last layer output {width} values, or change label_col"
    else:
        kind_text = f"one {'integer' if sample.label_integer else 'number'} per row"
        fix = f"make the model's last layer output 1 value, or give a label of {outputs} values per row"
        if sample.label_integer and outputs > 1:
            fix = "use loss_fn='cross_entropy' or one-hot the label"
    return (
        f"{loss} needs a label of shape {shape_text(output.shape[1:])} for a {outputs}-output model; "
        f"{sample.label} is {kind_text}; {fix}"
    )


def _per_position_problem(output: torch.Tensor, loss: str, sample: Sample) -> str | None:
    """Why logits cannot go with a label of class ids per position, (N, T); None if they can."""
    positions = tuple(sample.y.shape[1:])
    if output.ndim == sample.y.ndim + 1 and tuple(output.shape[1:-1]) == positions:
        return None
    wanted = shape_text(positions).removesuffix(")") + ", C)"
    return (
        f"{loss} with {sample.label} as {shape_text(positions)} class ids needs the model to output "
        f"{wanted} scores, the classes last (C = the number of classes); the model outputs "
        f"{shape_text(output.shape[1:])}"
        + (": move the class dimension last (logits.transpose(1, 2))" if output.ndim == 3 else "")
    )


# --------------------------------------------------------------------------- wording


def _shapes_text(shapes: dict[str, tuple[int, ...]]) -> str:
    if len(shapes) == 1:
        return shape_text(next(iter(shapes.values())))
    return "{" + ", ".join(f"{name}: {shape_text(shape)}" for name, shape in shapes.items()) + "}"


def _inputs_text(batch: Batch) -> str:
    if len(batch.inputs) == 1:
        return describe(next(iter(batch.inputs.values())))
    return "{" + ", ".join(f"{name}: {describe(t)}" for name, t in batch.inputs.items()) + "}"


def _is_integral(values: torch.Tensor) -> bool:
    if not values.is_floating_point():
        return True
    finite = values[torch.isfinite(values)]
    return bool(finite.numel()) and bool(torch.equal(finite, torch.round(finite)))


def _error_text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:_TEXT_LIMIT]}{' ...' if len(text) > _TEXT_LIMIT else ''}"


def _loss_name(loss: str | LossFn) -> str:
    return repr(loss) if isinstance(loss, str) else getattr(loss, "__qualname__", type(loss).__name__)
