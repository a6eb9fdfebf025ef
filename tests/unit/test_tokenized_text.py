"""Text tokenized on the executors (``data.tokenizer``, issue 55 item 3), on in-memory record
batches (no Spark): the ids and mask against the tokenizer's own ``encode_batch`` with its
own padding, truncation, fixed-length padding, bad rows, and one tokenization per row for
the whole fit (the epoch cache keeps the ids). The tokenizer is trained on the test's text:
no network."""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pytest
import torch

from sparkdl import BadDataError, ConfigError, SchemaError
from sparkdl.config import DataConfig
from sparkdl.data import text
from sparkdl.data.decoding import decode_block
from sparkdl.data.feed import FeedOptions, PartitionFeed
from sparkdl.data.inputs import IGNORED, plan_data
from sparkdl.data.screening import RowScreen
from sparkdl.data.tensors import to_batch

tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
NEUTRAL = "the a cat dog sat on mat rug ran to park home today it was and then we saw".split()
POSITIVE, NEGATIVE = "good great fine nice".split(), "bad awful poor sad".split()


def sentences(n, seed):
    """Rows of 3 to 9 words with one sentiment word among them; label 1 when it is positive."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        words = list(rng.choice(NEUTRAL, int(rng.integers(3, 10))))
        label = int(rng.integers(0, 2))
        words.insert(int(rng.integers(0, len(words) + 1)), str(rng.choice(POSITIVE if label else NEGATIVE)))
        rows.append((" ".join(words), label))
    return rows


def train_tokenizer(path, specials=SPECIALS):
    """A word-level tokenizer trained on the test's words, BERT's [CLS] ... [SEP] around each
    row, saved as tokenizer.json at ``path``; returns the path as a string."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=list(specials))
    tokenizer.train_from_iterator([" ".join(NEUTRAL + POSITIVE + NEGATIVE)], trainer)
    if "[CLS]" in specials:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            special_tokens=[(t, tokenizer.token_to_id(t)) for t in ("[CLS]", "[SEP]")],
        )
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")


def text_plan(path, max_length=0, fixed=False, **settings):
    data = open(path, "rb").read()
    schema = pa.schema([("text", pa.string()), ("label", pa.int64())])
    return plan_data(
        schema,
        inputs={"input_ids": "text"},
        label_col="label",
        mask_input="attention_mask",
        max_sequence_length=max_length,
        tokenizer=text.tokenization(data, path, max_length),
        pad_to_max_length=fixed,
        **settings,
    )


def record_batch(rows):
    return pa.RecordBatch.from_pydict({"text": [t for t, _ in rows], "label": [y for _, y in rows]})


def reference(path, texts, max_length=0, length=None):
    """The tokenizer's own padded ids and attention mask for ``texts``."""
    tokenizer = tokenizers.Tokenizer.from_file(path)
    tokenizer.enable_padding(pad_id=tokenizer.token_to_id("[PAD]"), pad_token="[PAD]", length=length)
    if max_length:
        tokenizer.enable_truncation(max_length)
    encodings = tokenizer.encode_batch(texts)
    return (
        torch.tensor([e.ids for e in encodings]),
        torch.tensor([e.attention_mask for e in encodings], dtype=torch.bool),
    )


@pytest.mark.parametrize(("max_length", "fixed"), [(0, False), (6, False), (12, True)])
def test_a_text_column_becomes_the_tokenizers_own_ids_and_attention_mask(tokenizer_file, max_length, fixed):
    rows = sentences(9, 0)
    plan = text_plan(tokenizer_file, max_length, fixed)
    batch = to_batch(decode_block(record_batch(rows), plan), plan)
    ids, mask = reference(tokenizer_file, [t for t, _ in rows], max_length, max_length if fixed else None)
    assert set(batch.inputs) == {"input_ids", "attention_mask"}
    assert batch.inputs["input_ids"].dtype == torch.int64
    assert torch.equal(batch.inputs["input_ids"], ids)
    assert torch.equal(batch.inputs["attention_mask"], mask)
    assert batch.label.tolist() == [y for _, y in rows]
    if max_length:  # truncated to the cap, the special tokens kept: [SEP] ends every full row
        sep = tokenizers.Tokenizer.from_file(tokenizer_file).token_to_id("[SEP]")
        lengths = mask.sum(dim=1)
        assert int(lengths.max()) == max_length and (lengths == max_length).any()
        assert all(int(ids[i, n - 1]) == sep for i, n in enumerate(lengths.tolist()))
    if fixed:
        assert ids.shape[1] == max_length


def test_a_text_column_is_tokenized_once_for_the_whole_fit_then_replayed_from_the_epoch_cache(
    tokenizer_file, monkeypatch
):
    calls = []
    encode = text.Tokenization.encode

    def counted(self, column, name):
        calls.append(len(column))
        return encode(self, column, name)

    monkeypatch.setattr(text.Tokenization, "encode", counted)
    rows = sentences(20, 1)
    plan = text_plan(tokenizer_file)
    source = (record_batch(rows[i : i + 7]) for i in range(0, 20, 7))
    feed = PartitionFeed(source, plan, FeedOptions(4, True, seed=3, rank=0, prefetch_batches=2))
    seen = []
    try:
        for epoch in range(1, 4):
            batches, where = feed.epoch(epoch)
            pairs = [zip(b.inputs["input_ids"], b.inputs["attention_mask"], strict=True) for b in batches]
            seen.append((where, sorted(row[mask].tolist() for rows_ in pairs for row, mask in rows_)))
    finally:
        feed.close()
    assert calls == [7, 7, 6]  # each record batch of epoch 1 once, in one encode_batch
    assert [where for where, _ in seen] == ["spark", "cache", "cache"]
    expected = sorted(
        e.ids for e in tokenizers.Tokenizer.from_file(tokenizer_file).encode_batch([t for t, _ in rows])
    )
    assert all(ids == expected for _, ids in seen)  # every row once an epoch, its own ids


def test_causal_lm_targets_of_tokenized_text_are_its_next_tokens_padding_left_out(tokenizer_file):
    plan = text_plan(tokenizer_file, next_token_of="input_ids")
    rows = [("the cat sat", 0), ("a dog", 0)]
    batch = to_batch(decode_block(record_batch(rows), plan), plan)
    ids = batch.inputs["input_ids"]
    assert batch.label[0].tolist() == [*ids[0, 1:].tolist(), IGNORED]  # [CLS] the cat sat [SEP]
    assert batch.label[1].tolist() == [*ids[1, 1:4].tolist(), IGNORED, IGNORED]  # padded after [SEP]


def test_null_texts_are_bad_data_counted_or_skipped(tokenizer_file):
    plan = text_plan(tokenizer_file)
    bad = pa.RecordBatch.from_pydict({"text": ["a cat", None, "good dog", None], "label": [0, 1, 1, 0]})
    with pytest.raises(BadDataError, match=r"'text' holds nulls in 2 of 4 rows") as caught:
        decode_block(bad, plan)
    assert (caught.value.column, caught.value.bad_rows) == ("text", 2)
    screen = RowScreen(plan)
    kept = screen.screen(bad)
    assert screen.dropped == 2 and kept.column("text").to_pylist() == ["a cat", "good dog"]


def test_a_tokenizer_travels_as_its_bytes_and_is_built_again_where_it_lands(tokenizer_file):
    tokenization = text_plan(tokenizer_file).inputs[0].text
    tokenization.encode(pa.array(["a cat"]), "text")  # builds the tokenizer here
    shipped = pickle.dumps(tokenization)
    assert len(shipped) < len(tokenization.json) + 500  # the bytes, not the built tokenizer
    landed = pickle.loads(shipped)
    assert landed.encode(pa.array(["a good cat"]), "text").values.tolist() == (
        tokenizers.Tokenizer.from_file(tokenizer_file).encode("a good cat").ids
    )


def test_the_padding_id_is_the_tokenizers_own(tmp_path):
    path = train_tokenizer(tmp_path / "t.json", ["<unk>", "<s>", "<pad>", "[UNK]"])
    data = open(path, "rb").read()
    assert text.tokenization(data, path).pad_id == 2  # its <pad>
    tokenizer = tokenizers.Tokenizer.from_file(path)
    tokenizer.enable_padding(pad_id=1, pad_token="<s>")
    assert text.tokenization(tokenizer.to_str().encode(), path).pad_id == 1  # its padding's


def test_wrong_tokenizer_settings_are_refused_saying_what_to_do(tokenizer_file, tmp_path, monkeypatch):
    from sparkdl.spark.driver import read_tokenizer

    schema = pa.schema([("text", pa.string()), ("ids", pa.list_(pa.int64())), ("label", pa.int64())])
    with pytest.raises(SchemaError, match=r"cannot feed input 'input_ids'.*data.tokenizer"):
        plan_data(schema, inputs={"input_ids": "text"}, label_col="label")
    tokenization = text_plan(tokenizer_file).inputs[0].text
    with pytest.raises(SchemaError, match=r"no input is one.*inputs=\{'input_ids': 'text'\}"):
        plan_data(schema, inputs={"input_ids": "ids"}, label_col="label", tokenizer=tokenization)
    with pytest.raises(ConfigError, match=r"'x.json' does not load as a tokenizers tokenizer"):
        text.tokenization(b'{"not": "a tokenizer"}', "x.json")
    with pytest.raises(ConfigError, match=r"cannot be read on the driver"):
        read_tokenizer(None, DataConfig(tokenizer=str(tmp_path / "missing.json")))
    monkeypatch.setattr(text, "MAX_TOKENIZER_BYTES", 100)
    with pytest.raises(ConfigError, match=r"is [\d,]+ bytes; at most 100 travel with the tasks"):
        read_tokenizer(None, DataConfig(tokenizer=tokenizer_file))
    with pytest.raises(ConfigError, match=r"pad_to_max_length = true.*set data.max_sequence_length"):
        DataConfig(pad_to_max_length=True)
