"""Driver side of the preflight: a few rows of the DataFrame through the user's model, before
the barrier stage starts.

The rows are fetched with ``limit(n).toArrow()`` (one small job, or none when Spark can
answer from a partition's head) and decoded by :class:`~sparkdl.data.feed.PartitionFeed`
itself, so the preflight batch has exactly the dtypes and shapes a worker's first batch has.
The model check itself is :func:`sparkdl.training.preflight.preflight` (pure torch).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import torch
from pyspark.sql import functions as F
from torch import nn

from sparkdl.config import UseGpu
from sparkdl.data.columns import LabelKind
from sparkdl.data.feed import FeedOptions, PartitionFeed
from sparkdl.data.inputs import DataPlan
from sparkdl.data.tensors import Batch
from sparkdl.errors import ModelMismatchError
from sparkdl.spark.cluster import described
from sparkdl.strategies import strategy_class
from sparkdl.training.preflight import PreflightReport, preflight

if TYPE_CHECKING:
    from sparkdl.worker.assembly import TrainSpec

log = logging.getLogger(__name__)

PREFLIGHT_ROWS = 8
_COLLECT_ABOVE_BYTES = 64 << 20
_GPU_KEYS = ("spark.executor.resource.gpu.amount", "spark.task.resource.gpu.amount")


def check_model(
    df: Any,
    spec: TrainSpec,
    batch: Batch | None,
    rows: int = PREFLIGHT_ROWS,
    on_model: Callable[[nn.Module], None] | None = None,
) -> PreflightReport | None:
    """Run the model, loss and one backward on ``batch`` (the first rows of ``df``,
    from :func:`sample_batch`) on the driver.

    Call it before the barrier stage: a model that does not fit the data then fails in
    seconds, once, with a message naming the columns and the layer.

    Returns:
        the report (output shape, parameter count), or None when ``batch`` is None (no
        usable row: the training stage then raises its own error, with the full count).

    ``on_model`` is handed the model the check built, before its forward (the pipeline's cut
    by measured time times it instead of building another).

    Raises:
        ModelMismatchError: the model, the loss and the data do not fit together.
    """
    if batch is None:
        log.info("preflight skipped: no usable rows in the first %d rows of the DataFrame", rows)
        return None
    plan = spec.plan
    label = plan.label
    label_integer = None
    if label is not None:
        label_type = df.select(label.name).schema.fields[0].dataType.typeName()
        label_integer = label_type in ("byte", "short", "integer", "long", "boolean")
    report = preflight(
        spec.model_fn,
        spec.optimizer_fn,
        spec.loss,
        batch,
        plan.describe_inputs(),
        f"the label column {label.name!r}" if label is not None else "the label",
        keyword=plan.keyword,
        label_integer=label_integer,
        strict=_strict(df.sparkSession, spec),
        model_check=_model_check(spec, on_model),
    )
    if report.parameters * 4 >= _COLLECT_ABOVE_BYTES:
        # The check's model is gone once nothing refers to it, unless the user's model holds
        # a reference cycle: free a large one now, not at some later collection, or the
        # driver holds it beside the trained weights when they arrive (measured: 3.2x a 2 GB
        # model's bytes at the peak, not 2.2x). A full collection costs ~0.2 s on a driver
        # with torch and pyspark loaded: not worth it for a small model.
        gc.collect()
    log.info("%s", report.summary())
    return report


def _model_check(
    spec: TrainSpec, on_model: Callable[[nn.Module], None] | None
) -> Callable[[nn.Module], None]:
    """The strategy's rules for the model (not for a user's own split: it runs on the workers'
    mesh only), then ``on_model``."""
    rules = strategy_class(spec.config.training.strategy).check_model

    def check(module: nn.Module) -> None:
        if spec.parallelize_fn is None:
            rules(module, spec.config)
        if on_model is not None:
            on_model(module)

    return check


def label_range(df: Any, plan: DataPlan) -> tuple[float, float] | None:
    """The smallest and largest class id over every row of ``df``: one aggregate over the
    label column alone (columnar sources read nothing else). None when the labels are not
    class ids in a numeric column of ``df`` (a regression, or labels ``transform_fn`` makes)."""
    label = plan.label
    if label is None or plan.label_kind is not LabelKind.CLASS_INDEX or plan.transform_fn is not None:
        return None
    numeric = ("byte", "short", "integer", "long", "float", "double", "boolean")
    kind = df.select(label.name).schema.fields[0].dataType
    column = F.col(label.name)
    if kind.typeName() == "array" and kind.elementType.typeName() in numeric:  # class ids per position
        smallest, largest = F.array_min(column), F.array_max(column)
    elif kind.typeName() in numeric:
        smallest = largest = column
    else:
        return None
    with described(df.sparkSession, "sparkdl fit: preflight, the label column's range"):
        row = df.agg(F.min(smallest.cast("double")), F.max(largest.cast("double"))).collect()[0]
    return None if row[0] is None else (float(row[0]), float(row[1]))


def check_label_range(found: tuple[float, float] | None, report: PreflightReport | None, column: str) -> None:
    """Refuse class ids the model has no output for, from ``found`` (:func:`label_range`)
    and the model's output width (``report``), before any worker starts.

    Raises:
        ModelMismatchError: the largest label is >= the model's outputs, or a label is negative.
    """
    if found is None or report is None or report.skipped or not report.output_shape:
        return
    smallest, largest = found
    classes = report.output_shape[-1]  # the classes are last, also for class ids per position
    where = "row" if len(report.output_shape) == 1 else "position"
    if largest >= classes:
        raise ModelMismatchError(
            f"the label column {column!r} holds class ids up to {largest:g} (over every row), but the "
            f"model outputs {classes} scores per {where} (classes 0..{classes - 1}); make its last layer "
            f"output {int(largest) + 1} values, or re-index the labels from 0"
        )
    if smallest < 0:
        raise ModelMismatchError(
            f"the label column {column!r} holds a negative class id ({smallest:g}); cross_entropy needs "
            f"class ids 0..{classes - 1}: re-index the labels from 0"
        )


def sample_batch(df: Any, plan: DataPlan, rows: int = PREFLIGHT_ROWS) -> Batch | None:
    """The first ``rows`` usable rows of ``df`` as a batch, decoded as a worker's feed
    decodes them (bad rows left out: the workers find them and count them all); None
    when there is none."""
    return batch_from_arrow(fetch_rows(df, plan, rows), plan, skip_bad_rows=True)


def fetch_rows(df: Any, plan: DataPlan, rows: int) -> pa.Table:
    """The first ``rows`` rows of the planned columns, as Arrow (classic and Connect alike)."""
    with described(df.sparkSession, f"sparkdl fit: preflight on {rows} rows"):
        return df.select(*plan.column_names).limit(rows).toArrow()


def batch_from_arrow(table: pa.Table, plan: DataPlan, skip_bad_rows: bool = False) -> Batch | None:
    """All rows of ``table`` as one batch, through :class:`PartitionFeed`
    (the same decoding, checks and tensors as training); None when no row is left."""
    if table.num_rows == 0:
        return None
    options = FeedOptions(
        batch_size=table.num_rows,
        shuffle=False,
        seed=0,
        rank=0,
        prefetch_batches=0,  # no thread: decode here
        skip_bad_rows=skip_bad_rows,
    )
    feed = PartitionFeed(iter(table.to_batches()), plan, options)
    try:
        batches, _ = feed.epoch(1)
        return next(iter(batches), None)
    finally:
        feed.close()


def _strict(spark: Any, spec: TrainSpec) -> bool:
    """Whether a failure preflight cannot explain is an error: not when the workers may train
    on GPUs and this driver has none (the failure may be the CPU's, e.g. a CUDA-only layer)."""
    if spec.config.runtime.use_gpu is UseGpu.NO or torch.cuda.is_available():
        return True
    for key in _GPU_KEYS:
        try:
            if float(spark.conf.get(key, "0") or 0) > 0:
                return False
        except Exception:  # a Connect server that will not tell: assume no GPUs
            continue
    return True
