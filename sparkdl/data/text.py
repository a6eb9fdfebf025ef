"""Text columns tokenized on the executors by a Hugging Face ``tokenizers`` tokenizer.

``data.tokenizer`` names a ``tokenizer.json`` (what ``tokenizers.Tokenizer.save`` writes, and
what every Hugging Face model repository ships). The driver reads it once, checks that it
loads, and ships its bytes in the data plan (:class:`Tokenization`), so executors need no
shared filesystem. Each worker builds the tokenizer once per task and encodes each Arrow
record batch's strings with one ``encode_batch`` call; the ids become a :class:`Ragged`
sequence like any array column in ``sequence_cols``, so the epoch cache keeps them after
epoch 1 (nothing is tokenized twice) and every batch is padded to its longest row with a
mask (or to ``data.max_sequence_length`` with ``data.pad_to_max_length``), with the
tokenizer's own padding id.

Pure: pyarrow, numpy and ``tokenizers`` (imported when a tokenizer is first built).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from sparkdl.data.blocks import Ragged
from sparkdl.errors import BadDataError, ConfigError

#: The largest tokenizer file shipped to the executors: the biggest public ones are
#: tens of MB (Llama 3's 9 MB, Gemma 3's 33 MB), and the file travels with every task.
MAX_TOKENIZER_BYTES = 64 << 20
#: Tokens taken as the padding id, in this order, when the file configures no padding.
PAD_TOKENS = ("[PAD]", "<pad>", "<|pad|>", "<|padding|>")


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as err:
        raise ConfigError(
            "data.tokenizer is set but the tokenizers library is not installed here; install "
            "sparkdl-torch[hf] (or `pip install tokenizers`) on the driver and every executor"
        ) from err
    return tokenizers


@dataclass(frozen=True)
class Tokenization:
    """How text columns become token ids: the tokenizer file's bytes and its settings.

    Attributes:
        json: the tokenizer file (``tokenizer.json``), as read on the driver.
        source: where it was read from (for messages).
        max_length: tokens a row keeps at most, the tokenizer's special tokens included
            (``data.max_sequence_length``; 0: no cap).
        pad_id: the id padding takes (the file's padding, else its pad token, else 0).
    """

    json: bytes = field(repr=False)
    source: str
    max_length: int = 0
    pad_id: int = 0

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The tokenizer, built once per process that holds this plan (it is not pickled)."""
        tokenizer = _tokenizers().Tokenizer.from_str(self.json.decode("utf-8"))
        tokenizer.no_padding()  # rows stay ragged: padded per batch, after the epoch cache
        if self.max_length > 0:
            tokenizer.enable_truncation(self.max_length)
        else:
            tokenizer.no_truncation()
        return tokenizer

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "tokenizer"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def encode(self, column: pa.Array | pa.ChunkedArray, name: str) -> Ragged:
        """The token ids of a string column's rows, one ``encode_batch`` call for all.

        Raises:
            BadDataError: null rows (naming the column and their count).
        """
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        if column.null_count:
            raise BadDataError(
                f"text column {name!r} holds nulls in {column.null_count} of {len(column)} rows of this "
                "batch; fill them (e.g. with '') or drop them before fit (or set on_bad_rows = 'skip')",
                column=name,
                bad_rows=column.null_count,
            )
        return encode_texts(self.tokenizer, column.to_pylist())


def encode_texts(tokenizer: Any, texts: list[str]) -> Ragged:
    """``texts`` through ``tokenizer.encode_batch`` as int64 ids, row after row."""
    encodings = tokenizer.encode_batch_fast(texts) if texts else []
    lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
    offsets = np.zeros(len(encodings) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64, count=int(offsets[-1]))
    return Ragged(values, offsets)


def tokenization(data: bytes, source: str, max_length: int = 0) -> Tokenization:
    """A :class:`Tokenization` of a tokenizer file's bytes, checked on the driver: it must be
    at most :data:`MAX_TOKENIZER_BYTES` and load with the ``tokenizers`` library.

    Raises:
        ConfigError: too large, or not a tokenizer file.
    """
    check_size(len(data), source)
    library = _tokenizers()
    try:
        tokenizer = library.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as err:  # the library raises a bare Exception on a malformed file
        raise ConfigError(
            f"data.tokenizer = {source!r} does not load as a tokenizers tokenizer ({err}); give the "
            "tokenizer.json a Hugging Face model ships, or one written by tokenizers.Tokenizer.save"
        ) from err
    return Tokenization(data, source, max_length, pad_id_of(tokenizer))


def check_size(size: int, source: str) -> None:
    """Refuse a tokenizer file over :data:`MAX_TOKENIZER_BYTES` (``size`` bytes).

    Raises:
        ConfigError: it is.
    """
    if size > MAX_TOKENIZER_BYTES:
        raise ConfigError(
            f"data.tokenizer = {source!r} is {size:,} bytes; at most {MAX_TOKENIZER_BYTES:,} travel "
            "with the tasks. Use a smaller tokenizer, or tokenize in transform_fn from storage every "
            "executor reads"
        )


def pad_id_of(tokenizer: Any) -> int:
    """The id the tokenizer pads with: its padding's, else the first of :data:`PAD_TOKENS` it
    knows, else 0 (padding is masked either way; the id matters to a model that reads it)."""
    padding = tokenizer.padding
    if padding and padding.get("pad_id") is not None:
        return int(padding["pad_id"])
    for token in PAD_TOKENS:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
    return 0


def is_text(typ: pa.DataType) -> bool:
    """Whether an Arrow type holds strings a tokenizer reads."""
    return bool(pa.types.is_string(typ) or pa.types.is_large_string(typ))
