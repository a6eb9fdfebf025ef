"""Named inputs, sequences, images, transform_fn, weights and the epoch caches, on
in-memory record batches (no Spark), each against values written out by hand or
computed another way (plain Python lists)."""

import itertools
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch import nn

from sparkdl import BadDataError, SchemaError
from sparkdl.data.blocks import Ragged
from sparkdl.data.cache import ArrowCache
from sparkdl.data.columns import LabelKind
from sparkdl.data.decoding import decode_block
from sparkdl.data.feed import FeedOptions, PartitionFeed
from sparkdl.data.inputs import plan_data
from sparkdl.data.screening import RowScreen
from sparkdl.data.tensors import call_model, to_batch

VECTOR = pa.struct(
    [
        ("type", pa.int8()),
        ("size", pa.int32()),
        ("indices", pa.list_(pa.int32())),
        ("values", pa.list_(pa.float64())),
    ]
)
IMAGE = pa.struct(
    [
        ("origin", pa.string()),
        ("height", pa.int32()),
        ("width", pa.int32()),
        ("nChannels", pa.int32()),
        ("mode", pa.int32()),
        ("data", pa.binary()),
    ]
)


def image(height, width, data):
    """One Spark image struct: 8-bit BGR, row-major."""
    data = bytes(np.asarray(data, dtype=np.uint8))
    return {"origin": "mem", "height": height, "width": width, "nChannels": 3, "mode": 16, "data": data}


def labels(n):
    return pa.array(np.arange(n, dtype=np.float64))


def batch_of(**columns):
    return pa.RecordBatch.from_pydict(columns)


# --------------------------------------------------------------------------- typed inputs


def test_each_column_type_becomes_an_input_of_its_own_dtype_and_shape():
    batch = batch_of(
        i32=pa.array([1, 2, 3], pa.int32()),
        i64=pa.array([4, 5, 6], pa.int64()),
        f=pa.array([0.5, 1.5, 2.5]),
        flag=pa.array([True, False, True]),
        arr=pa.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], pa.list_(pa.float32())),
        nest=pa.array([[[i, i + 1.0, i + 2.0], [i + 3.0, i + 4.0, i + 5.0]] for i in range(3)]),
        vec=pa.array(
            [
                {"type": 1, "size": None, "indices": None, "values": [7.0, 8.0]},
                {"type": 0, "size": 2, "indices": [1], "values": [4.0]},
                {"type": 0, "size": 2, "indices": [], "values": []},
            ],
            VECTOR,
        ),
        label=labels(3),
    )
    inputs = {n: n for n in ("i32", "i64", "f", "flag", "arr", "nest", "vec")} | {"dense": ["f", "i32"]}
    plan = plan_data(batch.schema, inputs=inputs, input_shapes={"arr": (2, 2)}, label_col="label")
    assert plan.keyword
    x = to_batch(decode_block(batch, plan), plan).inputs
    expected = {
        "i32": (torch.int64, [1, 2, 3]),
        "i64": (torch.int64, [4, 5, 6]),
        "f": (torch.float32, [0.5, 1.5, 2.5]),
        "flag": (torch.float32, [1.0, 0.0, 1.0]),
        "arr": (torch.float32, [[[1, 2], [3, 4]], [[5, 6], [7, 8]], [[9, 10], [11, 12]]]),
        "nest": (torch.float32, [[[i, i + 1, i + 2], [i + 3, i + 4, i + 5]] for i in range(3)]),
        "vec": (torch.float32, [[7, 8], [0, 4], [0, 0]]),
        "dense": (torch.float32, [[0.5, 1], [1.5, 2], [2.5, 3]]),
    }
    assert list(x) == list(expected)
    for name, (dtype, values) in expected.items():
        assert x[name].dtype == dtype, name
        assert x[name].tolist() == values, name


def test_input_shapes_that_do_not_fit_the_rows_are_a_schema_error():
    batch = batch_of(arr=pa.array([[1.0, 2.0, 3.0]]), label=labels(1))
    plan = plan_data(batch.schema, inputs={"arr": "arr"}, input_shapes={"arr": (2, 2)}, label_col="label")
    with pytest.raises(SchemaError, match=r"'arr' the shape \[2, 2\] \(4 values per row\).*hold 3 values"):
        decode_block(batch, plan)


# --------------------------------------------------------------------------- sequences

TOKENS = [[1, 2, 3], [4], [], [5, 6]]


def sequence_plan(batch, **kw):
    return plan_data(batch.schema, inputs={"tok": "tok"}, sequence_cols=("tok",), label_col="label", **kw)


def test_sequences_are_padded_per_batch_to_its_longest_row_with_a_mask():
    batch = batch_of(tok=pa.array(TOKENS, pa.list_(pa.int32())), label=labels(4))
    plan = sequence_plan(batch)
    block = decode_block(batch, plan)
    x = to_batch(block, plan).inputs
    assert (
        list(x) == ["tok", "tok_mask"] and x["tok"].dtype == torch.int64 and x["tok_mask"].dtype == torch.bool
    )
    assert x["tok"].tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0], [5, 6, 0]]
    assert x["tok_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]]
    # a batch of the shorter rows is only as wide as its own longest row
    tail = to_batch(block.rows(slice(1, 4)), plan).inputs
    assert tail["tok"].tolist() == [[4, 0], [0, 0], [5, 6]]
    assert tail["tok_mask"].tolist() == [[1, 0], [0, 0], [1, 1]]
    # so is a sliced record batch
    assert to_batch(decode_block(batch.slice(1, 2), plan), plan).inputs["tok"].tolist() == [[4], [0]]


def test_max_sequence_length_keeps_the_first_values():
    batch = batch_of(tok=pa.array(TOKENS, pa.list_(pa.int32())), label=labels(4))
    plan = sequence_plan(batch, max_sequence_length=2)
    x = to_batch(decode_block(batch, plan), plan).inputs
    assert x["tok"].tolist() == [[1, 2], [4, 0], [0, 0], [5, 6]]
    assert x["tok_mask"].tolist() == [[1, 1], [1, 0], [0, 0], [1, 1]]


def test_a_sequences_mask_takes_the_name_mask_input_gives_it_and_the_names_never_clash():
    """Hugging Face models take ``attention_mask``: ``data.mask_input`` names the mask, with
    ``{name}`` for the input's name (the default, ``{name}_mask``)."""
    batch = batch_of(tok=pa.array(TOKENS, pa.list_(pa.int32())), label=labels(4))
    plan = sequence_plan(batch, mask_input="attention_mask")
    x = to_batch(decode_block(batch, plan), plan).inputs
    assert list(x) == ["tok", "attention_mask"]
    assert x["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]]
    two = batch_of(a=pa.array(TOKENS, pa.list_(pa.int32())), b=pa.array(TOKENS, pa.list_(pa.int32())))
    both = {"inputs": {"a": "a", "b": "b"}, "sequence_cols": ("a", "b")}
    assert plan_data(two.schema, **both, mask_input="{name}_attention").masks == {
        "a_attention",
        "b_attention",
    }
    with pytest.raises(SchemaError, match=r"one name \('attention_mask'\); put \{name\} in it"):
        plan_data(two.schema, **both, mask_input="attention_mask")
    with pytest.raises(SchemaError, match="input 'b' clashes with the mask of sequence input 'a'"):
        plan_data(two.schema, inputs={"a": "a", "b": "b"}, sequence_cols=("a",), mask_input="b")


def test_mask_input_must_name_a_keyword_argument():
    from sparkdl.config.training_sections import DataConfig
    from sparkdl.errors import ConfigError

    assert DataConfig(mask_input="attention_mask").mask_input == "attention_mask"
    with pytest.raises(
        ConfigError, match=r"data.mask_input = 'attention mask' is not a keyword argument name"
    ):
        DataConfig(mask_input="attention mask")


def test_a_hugging_face_models_output_is_read_as_its_logits():
    """A ``ModelOutput`` (a classifier's ``SequenceClassifierOutput``) is what the loss and
    ``transform`` read as its ``logits``; a plain tensor or a mapping with logits as well."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=3,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config).eval()
    batch = batch_of(tok=pa.array(TOKENS, pa.list_(pa.int32())), label=labels(4))
    plan = plan_data(
        batch.schema, inputs={"input_ids": "tok"}, sequence_cols=("tok",), mask_input="attention_mask"
    )
    inputs = to_batch(decode_block(batch, plan), plan)
    with torch.no_grad():
        logits = call_model(model, inputs, keyword=True)
        direct = model(**inputs.inputs).logits
    assert isinstance(logits, torch.Tensor) and logits.shape == (4, 3) and torch.equal(logits, direct)

    class Mapping(nn.Module):
        def forward(self, x):
            return {"logits": x * 2, "hidden": x}

    plain = batch_of(x=pa.array([1.0, 2.0]))
    matrix = plan_data(plain.schema, feature_cols=("x",))
    features = to_batch(decode_block(plain, matrix), matrix)
    assert call_model(Mapping(), features, keyword=False).tolist() == [[2.0], [4.0]]


def test_causal_lm_targets_are_each_positions_next_token_and_its_loss_is_hugging_faces():
    """``loss_fn = "causal_lm"``: no label column; each position's target is the next token
    of its row, padding and each row's last position left out. On rows of one length the
    loss is a Hugging Face causal LM's own (its labels = the ids); with padding each row
    weighs the same, whatever its length."""
    from sparkdl.data.inputs import IGNORED
    from sparkdl.training.losses import resolve_loss

    batch = batch_of(tok=pa.array(TOKENS, pa.list_(pa.int32())))
    plan = plan_data(batch.schema, inputs={"tok": "tok"}, sequence_cols=("tok",), next_token_of="tok")
    label = to_batch(decode_block(batch, plan), plan).label
    assert label.tolist() == [[2, 3, IGNORED], [IGNORED] * 3, [IGNORED] * 3, [6, IGNORED, IGNORED]]
    assert plan.for_inference().next_token_of == ""
    with pytest.raises(SchemaError, match="trains on the next token of input 'x'"):
        plan_data(batch_of(x=pa.array([1.0, 2.0])).schema, inputs={"x": "x"}, next_token_of="x")

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=10, n_embd=16, n_layer=1, n_head=2, n_positions=8)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 10, (3, 5))
    loss_fn, _ = resolve_loss("causal_lm")
    with torch.no_grad():
        output = model(input_ids=ids, labels=ids)
        ours = loss_fn(output.logits, next_tokens_of(ids), None)
    assert abs(float(ours) - float(output.loss)) < 1e-6
    padded = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]])
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    logits = torch.randn(2, 4, 10)
    targets = next_tokens_of(padded, mask)
    rows = [
        torch.nn.functional.cross_entropy(logits[0, :3], padded[0, 1:]),
        torch.nn.functional.cross_entropy(logits[1, :1], padded[1, 1:2]),
    ]
    assert abs(float(loss_fn(logits, targets, None)) - float(sum(rows) / 2)) < 1e-6


def next_tokens_of(ids, mask=None):
    from sparkdl.data.tensors import next_tokens

    return next_tokens(ids, mask)


def test_ragged_arrays_not_declared_as_sequences_are_bad_data():
    batch = batch_of(tok=pa.array(TOKENS, pa.list_(pa.int32())), label=labels(4))
    plan = plan_data(batch.schema, inputs={"tok": "tok"}, label_col="label")
    with pytest.raises(
        BadDataError, match=r"'tok' has rows of different lengths: 3 of 4 rows.*sequence_cols"
    ) as info:
        decode_block(batch, plan)
    assert info.value.column == "tok" and info.value.bad_rows == 3


def test_a_null_element_in_a_sequence_is_bad_data():
    batch = batch_of(tok=pa.array([[1, None], [4], [None, 2, None]], pa.list_(pa.int32())), label=labels(3))
    with pytest.raises(
        BadDataError,
        match=r"^array column 'tok': 2 of 3 rows of this batch hold a null element \(3 nulls in all; "
        r"the first in row 0: \[1, None\]\); .*F\.coalesce.*on_bad_rows = 'skip'",
    ) as info:
        decode_block(batch, sequence_plan(batch))
    assert info.value.column == "tok" and info.value.bad_rows == 2


def test_only_arrays_of_numbers_can_be_sequences():
    batch = batch_of(tok=pa.array([[[1.0, 2.0]], [[3.0, 4.0], [5.0, 6.0]]]), label=labels(2))
    with pytest.raises(
        SchemaError, match=r"sequence column 'tok' must be an array of numbers.*sequence_cols"
    ):
        sequence_plan(batch)


def test_a_float_sequence_batch_of_empty_rows_decodes():
    batch = batch_of(tok=pa.array([[], []], pa.list_(pa.float32())), label=labels(2))
    plan = sequence_plan(batch)
    x = to_batch(decode_block(batch, plan), plan).inputs
    assert tuple(x["tok"].shape) == (2, 0) and tuple(x["tok_mask"].shape) == (2, 0)


def test_nan_in_a_float_sequence_counts_its_rows():
    tokens = [[1.0, float("nan"), float("nan")], [2.0], [float("inf")]]
    batch = batch_of(tok=pa.array(tokens, pa.list_(pa.float32())), label=labels(3))
    with pytest.raises(BadDataError, match=r"NaN or infinite values in 2 of 3 rows") as info:
        decode_block(batch, sequence_plan(batch))
    assert info.value.column == "tok" and info.value.bad_rows == 2


# --------------------------------------------------------------------------- images


def bgr(i):
    """Image i's 2x3 BGR bytes, row-major: pixel (r, c) channel k holds 20 * i + 9 * r + 3 * c + k."""
    return [20 * i + 9 * r + 3 * c + k for r in range(2) for c in range(3) for k in range(3)]


def test_spark_images_become_float_rgb_chw_in_zero_one():
    batch = pa.RecordBatch.from_arrays(
        [pa.array([image(2, 3, bgr(i)) for i in range(3)], IMAGE), labels(3)], ["img", "label"]
    )
    plan = plan_data(batch.schema, inputs={"img": "img"}, label_col="label")
    block = decode_block(batch, plan)
    assert block.inputs["img"].dtype == np.uint8 and block.inputs["img"].shape == (3, 3, 2, 3)
    x = to_batch(block, plan).inputs["img"]
    assert x.dtype == torch.float32 and tuple(x.shape) == (3, 3, 2, 3)
    # RGB channel ch is BGR byte 2 - ch
    expected = [
        [[[(20 * i + 9 * r + 3 * c + 2 - ch) / 255 for c in range(3)] for r in range(2)] for ch in range(3)]
        for i in range(3)
    ]
    torch.testing.assert_close(x, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=0)
    assert (x[0, 0] * 255).round().tolist() == [[2, 5, 8], [11, 14, 17]]  # red of image 0
    assert (x[0, 2] * 255).round().tolist() == [[0, 3, 6], [9, 12, 15]]  # blue of image 0
    sliced = to_batch(decode_block(batch.slice(1, 2), plan), plan).inputs["img"]
    torch.testing.assert_close(sliced, x[1:3], rtol=0, atol=0)


def test_images_of_different_sizes_are_bad_data_with_the_count():
    images = [image(2, 3, bgr(0)), image(3, 2, bgr(1)), image(2, 3, bgr(2)), image(1, 1, [1, 2, 3])]
    batch = pa.RecordBatch.from_arrays([pa.array(images, IMAGE), labels(4)], ["img", "label"])
    plan = plan_data(batch.schema, inputs={"img": "img"}, label_col="label")
    with pytest.raises(
        BadDataError, match=r"image column 'img' holds images of different sizes: 2 of 4 rows"
    ) as info:
        decode_block(batch, plan)
    assert info.value.column == "img" and info.value.bad_rows == 2


# --------------------------------------------------------------------------- transform_fn


def test_binary_columns_must_go_through_transform_fn():
    batch = batch_of(raw=pa.array([b"\x01"]), label=labels(1))
    with pytest.raises(SchemaError, match=r"column 'raw' \(binary\) cannot feed input 'raw'.*transform_fn"):
        plan_data(batch.schema, inputs={"raw": "raw"}, label_col="label")


def pairs(batch):
    raw = batch.column("raw").to_pylist()
    return {"x": np.array([[float(b[0]), float(b[1])] for b in raw]), "scale": np.full(len(raw), 10)}


class ScaledSum(nn.Module):
    def forward(self, *, x, scale):  # keyword-only: fails unless called as model(**inputs)
        return x.sum(dim=1) * scale


def test_transform_fn_outputs_are_keyword_inputs_float64_as_float32():
    batch = batch_of(raw=pa.array([b"\x01\x02", b"\x03\x04", b"\x05\x06"]), label=labels(3))
    plan = plan_data(batch.schema, transform_fn=pairs, label_col="label")
    assert plan.keyword and plan.extra_columns == ("raw",)
    block = decode_block(batch, plan)
    assert block.inputs["x"].dtype == np.float32 and block.inputs["scale"].dtype == np.int64
    np.testing.assert_array_equal(block.inputs["x"], [[1, 2], [3, 4], [5, 6]])
    out = call_model(ScaledSum(), to_batch(block, plan), plan.keyword)
    assert out.dtype == torch.float32 and out.tolist() == [30.0, 70.0, 110.0]


def test_transform_fn_must_return_one_row_per_input_row():
    batch = batch_of(raw=pa.array([b"\x01", b"\x02", b"\x03"]), label=labels(3))
    plan = plan_data(batch.schema, transform_fn=lambda b: {"x": np.zeros((2, 1))}, label_col="label")
    with pytest.raises(SchemaError, match=r"arrays of \{'x': 2\} rows for a batch of 3 rows"):
        decode_block(batch, plan)


def test_transform_fn_is_told_whether_it_is_training():
    seen = []

    def fn(batch, training):
        seen.append(training)
        return {"x": np.zeros((batch.num_rows, 1))}

    batch = batch_of(raw=pa.array([b"\x01"]), label=labels(1))
    plan = plan_data(batch.schema, transform_fn=fn, label_col="label")
    decode_block(batch, plan)
    decode_block(batch, plan, training=False)
    assert seen == [True, False]


def test_a_label_or_weight_from_transform_fn_is_checked_like_a_column():
    batch = batch_of(raw=pa.array([b"\x01", b"\x02"]), w=pa.array([1.0, 1.0]), label=labels(2))

    def fn(batch):
        return {"x": np.zeros((2, 1)), "label": np.array([1.0, 2.5]), "w": np.array([1, -3])}

    plan = plan_data(batch.schema, transform_fn=fn, label_col="label", label_kind=LabelKind.CLASS_INDEX)
    with pytest.raises(BadDataError, match=r"1 rows hold negative or non-integer values") as info:
        decode_block(batch, plan)
    assert info.value.column == "label"
    ok = plan_data(
        batch.schema, transform_fn=lambda b: {**fn(b), "label": np.array([1.0, 2.0])}, label_col="label"
    )
    assert decode_block(batch, ok).label.dtype == np.float32
    weighted = plan_data(batch.schema, transform_fn=fn, label_col="label", weight_col="w")
    with pytest.raises(BadDataError, match=r"weight column 'w' holds negative.* in 1 of 2 rows"):
        decode_block(batch, weighted)


# --------------------------------------------------------------------------- weights


def test_weights_decode_as_float32_and_must_not_be_negative():
    batch = batch_of(x=pa.array([1.0, 2.0, 3.0]), w=pa.array([2, 0, 1], pa.int32()), label=labels(3))
    plan = plan_data(batch.schema, feature_cols=("x",), label_col="label", weight_col="w")
    weight = decode_block(batch, plan).weight
    assert weight.dtype == np.float32 and weight.tolist() == [2.0, 0.0, 1.0]
    bad = batch_of(x=pa.array([1.0, 2.0, 3.0]), w=pa.array([2.0, -0.5, 1.0]), label=labels(3))
    with pytest.raises(
        BadDataError, match=r"weight column 'w' holds negative, NaN or infinite weights in 1 of 3"
    ) as info:
        decode_block(bad, plan_data(bad.schema, feature_cols=("x",), label_col="label", weight_col="w"))
    assert info.value.column == "w" and info.value.bad_rows == 1


# --------------------------------------------------------------------------- Ragged


def as_lists(ragged):
    return [ragged.values[a:b].tolist() for a, b in itertools.pairwise(ragged.offsets)]


def random_ragged(rng, rows, element=()):
    reference = [rng.integers(0, 100, size=(rng.integers(0, 6), *element)).tolist() for _ in range(rows)]
    lengths = [len(r) for r in reference]
    values = np.array([v for r in reference for v in r], dtype=np.int64).reshape(-1, *element)
    return Ragged(values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)), reference


@pytest.mark.parametrize("element", [(), (2,)])
def test_ragged_rows_concat_and_padding_match_plain_lists(element):
    rng = np.random.default_rng(7)
    for _ in range(30):
        ragged, reference = random_ragged(rng, int(rng.integers(0, 12)), element)
        start, stop = sorted(int(v) for v in rng.integers(0, len(reference) + 2, size=2))
        for s in (slice(start, stop), slice(stop, start), slice(None, None, 2), slice(None, None, -1)):
            assert as_lists(ragged.rows(s)) == reference[s]
        window = reference[start:stop]
        index = (
            rng.integers(0, len(window), size=int(rng.integers(0, 8))) if window else np.zeros(0, np.int64)
        )
        # a gather (with repeats) from a slice, whose offsets do not start at 0
        assert as_lists(ragged.rows(slice(start, stop)).rows(index)) == [window[i] for i in index]
        other, other_reference = random_ragged(rng, int(rng.integers(1, 6)), element)
        parts = [ragged.rows(slice(start, stop)), other.rows(slice(1, None)), ragged]
        joined = Ragged.concat(parts)
        assert as_lists(joined) == reference[start:stop] + other_reference[1:] + reference
        assert joined.offsets[0] == 0 and len(joined.values) == joined.offsets[-1]
        for cap in (0, 2):
            values, mask = ragged.rows(slice(start, stop)).padded(cap)
            rows = [r[:cap] if cap else r for r in reference[start:stop]]
            width = max((len(r) for r in rows), default=0)
            pad = [0] * element[0] if element else 0
            assert values.tolist() == [r + [pad] * (width - len(r)) for r in rows]
            assert mask.tolist() == [[j < len(r) for j in range(width)] for r in rows]


# --------------------------------------------------------------------------- skipping bad rows


def test_skip_mode_drops_bad_rows_of_typed_inputs_and_counts_them():
    tokens = [[1, 2], [3, None], [4], [], [5, 6, 7], [8], [9]]
    images = [image(2, 3, bgr(i)) for i in range(7)]
    images[2] = image(3, 3, [0] * 27)
    batch = pa.RecordBatch.from_pydict(
        {
            "id": pa.array(range(7), pa.int64()),
            "tok": pa.array(tokens, pa.list_(pa.int32())),
            "img": pa.array(images, IMAGE),
            "f": pa.array([0.0, 1.0, 2.0, float("nan"), 4.0, 5.0, 6.0], pa.float32()),
            "w": pa.array([1.0, 1.0, 1.0, 1.0, -1.0, 1.0, 0.0]),
            "label": labels(7),
        }
    )
    inputs = {"id": "id", "tok": "tok", "img": "img", "f": "f"}
    plan = plan_data(batch.schema, inputs=inputs, sequence_cols=("tok",), label_col="label", weight_col="w")
    screen = RowScreen(plan)
    kept = screen.screen(batch)
    # dropped: 1 null element in the sequence, 2 image of another size, 3 NaN, 4 negative weight
    assert kept.column("id").to_pylist() == [0, 5, 6] and screen.dropped == 4
    x = to_batch(decode_block(kept, plan), plan)
    assert x.inputs["tok"].tolist() == [[1, 2], [8, 0], [9, 0]]
    assert x.inputs["f"].tolist() == [0.0, 5.0, 6.0] and x.weight.tolist() == [1.0, 1.0, 0.0]
    assert (x.inputs["img"][:, 2, 0, 0] * 255).round().tolist() == [0, 100, 120]


def test_skip_mode_survives_a_batch_with_no_good_rows():
    plan = plan_data(
        pa.schema([("arr", pa.list_(pa.float64())), ("label", pa.float64())]),
        inputs={"arr": "arr"},
        input_shapes={"arr": (2, 2)},
        label_col="label",
    )
    screen = RowScreen(plan)
    good = batch_of(arr=[[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], label=[0.0, 1.0])
    assert screen.screen(good).num_rows == 2
    # every row structurally bad: the rest of the screen (and decoding) sees no rows
    nothing = screen.screen(batch_of(arr=[None, [1.0]], label=[0.0, 1.0]))
    assert nothing.num_rows == 0 and screen.dropped == 2
    assert decode_block(nothing, plan).inputs["arr"].shape == (0, 2, 2)


# --------------------------------------------------------------------------- the feed and its caches


def number_batches(starts, stop):
    bounds = [*starts, stop]
    for a, b in itertools.pairwise(bounds):
        yield batch_of(
            x=pa.array(np.arange(a, b, dtype=np.float64)), label=pa.array(np.arange(a, b, dtype=np.float64))
        )


def run_epochs(plan, source, epochs, batch_size=3, shuffle=True):
    """Per epoch: where the rows came from, and every batch as (labels, x) lists."""
    feed = PartitionFeed(source, plan, FeedOptions(batch_size, shuffle, seed=5, rank=0, prefetch_batches=2))
    try:
        out = []
        for epoch in range(1, epochs + 1):
            batches, where = feed.epoch(epoch)
            out.append((where, [(b.label.tolist(), b.inputs["x"][:, 0].tolist()) for b in batches]))
        return out
    finally:
        feed.close()


@pytest.mark.parametrize("cache_transformed", [False, True])
def test_transform_fn_reruns_every_epoch_unless_its_output_is_cached(cache_transformed):
    noise = np.random.default_rng(0)
    calls = []

    def noisy(batch):
        calls.append(batch.num_rows)
        x = batch.column("x").to_numpy()
        return {"x": (x + noise.normal(size=len(x)))[:, None]}

    schema = next(number_batches([0], 1)).schema
    plan = plan_data(schema, transform_fn=noisy, label_col="label", cache_transformed=cache_transformed)
    assert plan.transforms_every_epoch is not cache_transformed
    epochs = run_epochs(plan, number_batches([0, 4, 8], 10), 3)
    assert [where for where, _ in epochs] == ["spark", "cache", "cache"]
    assert [len(b[0]) for b in epochs[1][1]] == [3, 3, 3, 1]
    # calls: the 3 Arrow batches in epoch 1, then 4 replayed batches per epoch if not cached
    assert len(calls) == (3 if cache_transformed else 11)
    x_of = [{y: x for b in batches for y, x in zip(*b, strict=True)} for _, batches in epochs]
    assert all(sorted(x) == [float(i) for i in range(10)] for x in x_of)
    for later in x_of[1:]:
        same = [later[y] == x_of[0][y] for y in later]
        assert all(same) if cache_transformed else not any(same)


@pytest.mark.parametrize("memory_mb", [256, 0])
@pytest.mark.parametrize("reused_buffer", [False, True])
def test_a_model_changing_its_input_in_place_in_epoch_1_leaves_the_epoch_cache_alone(
    memory_mb, reused_buffer
):
    # epoch 1's tensors share memory with the decoded chunk (the float64 x is cast into a new
    # writeable array, and not shuffled: slices); a transform_fn may also reuse its buffer
    buffer = np.zeros((4, 1), np.float32)

    def into_one_buffer(batch):
        x = batch.column("x").to_numpy()
        buffer[: len(x), 0] = x
        return {"x": buffer[: len(x)]}

    schema = next(number_batches([0], 1)).schema
    plan = (
        plan_data(schema, transform_fn=into_one_buffer, label_col="label", cache_transformed=True)
        if reused_buffer
        else plan_data(schema, feature_cols=("x",), label_col="label")
    )
    options = FeedOptions(2, False, seed=5, rank=0, prefetch_batches=0, cache_memory_bytes=memory_mb << 20)
    feed = PartitionFeed(number_batches([0, 4, 8], 10), plan, options)
    try:
        first, _ = feed.epoch(1)
        seen = []
        for b in first:
            (x,) = b.inputs.values()
            seen += x[:, 0].tolist()
            x.mul_(-1)  # e.g. nn.ReLU(inplace=True) as the first layer
        later, where = feed.epoch(2)
        assert where == "cache" and seen == [float(i) for i in range(10)]
        assert [x for b in later for x in next(iter(b.inputs.values()))[:, 0].tolist()] == seen
    finally:
        feed.close()


def test_the_raw_row_cache_replays_a_shuffled_order_across_chunks(tmp_path):
    decoded = []
    cache = ArrowCache(lambda b: decoded.append(b.column("x").to_pylist()) or b, str(tmp_path))
    try:
        for batch in number_batches([0, 4, 5, 11], 13):
            cache.append(batch)
        cache.seal()
        order = np.random.default_rng(3).permutation(13)
        list(cache.batches(5, order))
        assert decoded == [order[:5].tolist(), order[5:10].tolist(), order[10:].tolist()]
        decoded.clear()
        list(cache.batches(5))
        assert decoded == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12]]
    finally:
        cache.close()


def test_every_row_comes_exactly_once_per_shuffled_epoch_with_a_sequence_input():
    rng = np.random.default_rng(0)
    rows = [(i, rng.integers(1, 100, size=rng.integers(0, 6)).tolist()) for i in range(23)]

    def source():
        for a, b in ((0, 7), (7, 8), (8, 15), (15, 23)):
            yield batch_of(
                id=pa.array([r[0] for r in rows[a:b]], pa.int64()),
                tok=pa.array([r[1] for r in rows[a:b]], pa.list_(pa.int64())),
                label=pa.array([float(r[0]) for r in rows[a:b]]),
            )

    schema = next(source()).schema
    plan = plan_data(schema, inputs={"id": "id", "tok": "tok"}, sequence_cols=("tok",), label_col="label")
    feed = PartitionFeed(source(), plan, FeedOptions(4, True, seed=3, rank=0, prefetch_batches=2))
    expected = Counter((i, tuple(t)) for i, t in rows)
    orders = []
    try:
        for epoch in (1, 2, 3):
            batches, _ = feed.epoch(epoch)
            seen: Counter = Counter()
            order = []
            for b in batches:
                assert b.label.long().tolist() == b.inputs["id"].tolist()
                assert not b.inputs["tok"][~b.inputs["tok_mask"]].any()  # padding is zeros
                for i, tok, mask in zip(
                    b.inputs["id"].tolist(), b.inputs["tok"], b.inputs["tok_mask"], strict=True
                ):
                    seen[(i, tuple(tok[mask].tolist()))] += 1
                    order.append(i)
            assert seen == expected, epoch
            orders.append(order)
    finally:
        feed.close()
    assert len({tuple(o) for o in orders}) == 3 and sorted(orders[0]) == list(range(23))
