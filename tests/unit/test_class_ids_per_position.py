"""Class ids per position (a language model's next tokens, a tag per token): an ``array<int>``
label of T ids per row with logits ``(N, T, C)``, through the loss, the label checks, the
preflight, validation and ``transform``'s columns."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparkdl.apps.models import CausalLMFactory
from sparkdl.config import UseGpu
from sparkdl.data.columns import LabelKind
from sparkdl.data.decoding import decode_block
from sparkdl.data.inputs import plan_data
from sparkdl.data.tensors import Batch, to_batch
from sparkdl.errors import BadDataError, ModelMismatchError
from sparkdl.spark.inference import (
    ModelWeights,
    OutputCols,
    OutputMode,
    PredictSpec,
    output_mode,
    predict_partition,
    prediction_schema,
)
from sparkdl.spark.preflight import check_label_range
from sparkdl.training.factory import state_to_bytes
from sparkdl.training.losses import resolve_loss
from sparkdl.training.preflight import preflight

VOCAB, LENGTH = 11, 6
LM = CausalLMFactory(VOCAB, LENGTH, dim=8, layers=1, heads=2)


def token_batch(rows: int = 5, seed: int = 0) -> pa.RecordBatch:
    """``tokens`` and ``next``: rows of LENGTH + 1 ids, the label the same row shifted by one."""
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(rows, LENGTH + 1))
    return pa.RecordBatch.from_arrays(
        [
            pa.array(ids[:, :-1].tolist(), pa.list_(pa.int32())),
            pa.array(ids[:, 1:].tolist(), pa.list_(pa.int64())),
        ],
        ["tokens", "next"],
    )


def plan(batch: pa.RecordBatch):
    """``tokens`` as a named input (ids stay int64; the model is called as ``model(tokens=...)``)."""
    return plan_data(
        batch.schema, inputs={"tokens": "tokens"}, label_col="next", label_kind=LabelKind.CLASS_INDEX
    )


def test_the_loss_is_torchs_cross_entropy_over_every_position_and_weighs_rows_by_their_mean():
    torch.manual_seed(0)
    logits, target = torch.randn(4, LENGTH, VOCAB), torch.randint(0, VOCAB, (4, LENGTH))
    loss_fn, kind = resolve_loss("cross_entropy")
    assert kind is LabelKind.CLASS_INDEX

    flat = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
    assert float(loss_fn(logits, target, None)) == pytest.approx(float(flat), abs=1e-6)
    weight = torch.tensor([1.0, 0.0, 2.0, 0.5])
    per_row = F.cross_entropy(logits.transpose(1, 2), target, reduction="none").mean(dim=1)
    assert float(loss_fn(logits, target, weight)) == pytest.approx(float((per_row * weight).mean()), abs=1e-6)


def test_the_label_array_decodes_to_int64_ids_and_a_row_with_a_bad_id_is_named():
    batch = token_batch()
    block = decode_block(batch, plan(batch))
    expected = np.array(batch.column("next").to_pylist())
    assert block.label.dtype == np.int64 and block.label.shape == (5, LENGTH)
    np.testing.assert_array_equal(block.label, expected)

    bad = pa.array([[0, 1, 2, 3, 4, 5], [1, 2, -3, 4, 5, 6]], pa.list_(pa.int64()))
    rows = pa.RecordBatch.from_arrays([batch.column("tokens").slice(0, 2), bad], ["tokens", "next"])
    with pytest.raises(BadDataError, match=r"1 rows hold negative or non-integer values \(e\.g\. -3\)"):
        decode_block(rows, plan(rows))


def sample(batch: pa.RecordBatch) -> Batch:
    """The rows as the feed hands them to the model: ``tokens`` int64 ``[N, T]``, the label too."""
    return to_batch(decode_block(batch, plan(batch)), plan(batch))


def test_the_preflight_takes_logits_with_the_classes_last_and_tells_how_to_move_them():
    report = preflight(
        LM, None, "cross_entropy", sample(token_batch()), "the feature columns", "the label column"
    )
    assert report.output_shape == (LENGTH, VOCAB)

    class ClassesSecond(nn.Module):  # torch's own (N, C, T): ambiguous when C == T, so refused
        def __init__(self) -> None:
            super().__init__()
            self.lm = LM()

        def forward(self, tokens):
            return self.lm(tokens).transpose(1, 2)

    with pytest.raises(ModelMismatchError) as caught:
        preflight(
            ClassesSecond, None, "cross_entropy", sample(token_batch()), "the features", "the label 'next'"
        )
    assert str(caught.value) == (
        "cross_entropy with the label 'next' as (N, 6) class ids needs the model to output (N, 6, C) "
        "scores, the classes last (C = the number of classes); the model outputs (N, 11, 6): move the "
        "class dimension last (logits.transpose(1, 2))"
    )


def test_the_label_range_over_every_row_is_checked_against_the_classes_per_position():
    report = preflight(
        LM, None, "cross_entropy", sample(token_batch()), "the feature columns", "the label column"
    )
    check_label_range((0.0, VOCAB - 1.0), report, "next")  # every id has a score
    with pytest.raises(ModelMismatchError) as caught:
        check_label_range((0.0, VOCAB + 2.0), report, "next")
    assert "holds class ids up to 13 (over every row), but the model outputs 11 scores per position" in str(
        caught.value
    )


def test_validation_accuracy_counts_positions_not_rows(gloo_group):
    from sparkdl.training.validation import Validator

    torch.manual_seed(0)
    module = LM()
    held = [sample(token_batch(3, seed=1)), sample(token_batch(4, seed=2))]
    loss_fn, _ = resolve_loss("cross_entropy")
    figures = Validator(
        lambda: held, loss_fn, LabelKind.CLASS_INDEX, True, torch.device("cpu"), None
    ).evaluate(module)
    with torch.no_grad():
        out = torch.cat([module(**b.inputs) for b in held])
    labels = torch.cat([b.label for b in held])
    assert figures["val_samples"] == 7
    assert figures["val_loss"] == pytest.approx(
        float(F.cross_entropy(out.reshape(-1, VOCAB), labels.reshape(-1))), abs=1e-6
    )
    assert figures["val_accuracy"] == pytest.approx(float((out.argmax(-1) == labels).float().mean()))


def test_transform_writes_the_class_of_every_position_as_an_array_of_doubles():
    from pyspark.sql.types import ArrayType, DoubleType, StructType

    assert output_mode(True, (LENGTH, VOCAB)) is OutputMode.SEQUENCE
    assert output_mode(False, (LENGTH, VOCAB)) is OutputMode.ARRAY  # a regression's outputs stay whole
    columns = OutputCols("prediction", "rawPrediction", "probability")
    assert columns.added(OutputMode.SEQUENCE) == [("prediction_col", "prediction")]
    schema = prediction_schema(StructType([]), columns, OutputMode.SEQUENCE)
    assert schema.fields[0].dataType == ArrayType(DoubleType(), containsNull=False)

    torch.manual_seed(0)
    module = LM().eval()
    state = state_to_bytes(module)
    batch = token_batch(5)
    spec = PredictSpec(
        lambda: LM(),
        ModelWeights(hashlib.sha256(state).hexdigest(), data=state),
        plan(batch).for_inference(),
        columns,
        OutputMode.SEQUENCE,
        2,  # chunks of 2, 2 and 1 rows
        UseGpu.NO,
        1,
    )
    (out,) = predict_partition(spec, iter([batch]))
    with torch.no_grad():
        expected = module(torch.tensor(batch.column("tokens").to_pylist())).argmax(-1).double()
    assert out.schema.names == ["tokens", "next", "prediction"]
    assert out.column("prediction").to_pylist() == expected.tolist()


def test_transform_scores_each_row_of_a_causal_lm_with_its_perplexity_padding_left_out():
    """``perplexity`` (``loss_fn = "causal_lm"``): exp of the row's mean next-token loss over
    the positions that have a next token, what the model's own loss gives on the row alone
    (unpadded); NaN for a row of one token."""
    transformers = pytest.importorskip("transformers")
    from pyspark.sql.types import DoubleType, StructType

    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=8)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    rows = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10], [3, 1, 4, 1]]
    batch = pa.RecordBatch.from_arrays([pa.array(rows, pa.list_(pa.int32()))], ["tok"])
    plan = plan_data(
        batch.schema, inputs={"input_ids": "tok"}, sequence_cols=("tok",), mask_input="attention_mask"
    )
    columns = OutputCols("prediction", perplexity="perplexity")
    assert columns.added(OutputMode.SEQUENCE) == [
        ("prediction_col", "prediction"),
        ("perplexity_col", "perplexity"),
    ]
    assert prediction_schema(StructType([]), columns, OutputMode.SEQUENCE).fields[1].dataType == DoubleType()
    state = state_to_bytes(model)
    spec = PredictSpec(
        lambda: transformers.GPT2LMHeadModel(config),
        ModelWeights(hashlib.sha256(state).hexdigest(), data=state),
        plan,
        columns,
        OutputMode.SEQUENCE,
        3,  # chunks of 3 and 1 rows, each padded to its longest
        UseGpu.NO,
        1,
        perplexity_of="input_ids",
    )
    (out,) = predict_partition(spec, iter([batch]))
    got = out.column("perplexity").to_pylist()
    with torch.no_grad():
        for row, perplexity in zip(rows, got, strict=True):
            if len(row) == 1:
                assert np.isnan(perplexity)
                continue
            ids = torch.tensor([row])
            assert perplexity == pytest.approx(float(model(input_ids=ids, labels=ids).loss.exp()), rel=1e-5)
