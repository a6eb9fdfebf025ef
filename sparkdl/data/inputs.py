"""Which columns feed the model, as which inputs, and how a record batch becomes a :class:`Block`.

Three ways to feed a model, decided once on the driver from the DataFrame's schema
(:func:`plan_data`) and shipped to every worker:

* ``feature_cols = [...]``: one float32 matrix of every listed column, ``model(x)``.
* ``inputs = {name: column or [columns]}``: ``model(**inputs)``. One column keeps its own
  dtype and shape (integers int64 for ``nn.Embedding``, numbers float32, arrays
  ``[k]`` or the shape ``input_shapes`` gives, nested arrays N-d, Vectors dense, Spark
  images uint8 CHW that the batch turns into float32 in [0, 1]); a list of columns is one
  float32 matrix; a column listed in ``sequence_cols`` may hold arrays of any length,
  padded per batch to the longest row with a boolean mask input (``<name>_mask``, or as
  ``data.mask_input`` names it: ``attention_mask`` for Hugging Face models).
* ``transform_fn(record_batch) -> {name: array}`` on the executors, for what no built-in
  decoder reads (image files as bytes): its keys other than the label and weight
  columns are inputs too.

With ``data.tokenizer``, an input of one string column is text: tokenized on the executors
(:mod:`sparkdl.data.text`) into token ids fed as a sequence, with its mask.

Pure: pyarrow and numpy, no torch and no Spark.
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa

from sparkdl.data.columns import (
    ColumnKind,
    ColumnSpec,
    LabelKind,
    kind_of_arrow_type,
)
from sparkdl.data.text import Tokenization, is_text
from sparkdl.errors import SchemaError

#: ``transform_fn(batch) -> {name: array}``; it may also take ``training: bool``.
TransformFn = Callable[..., Mapping[str, Any]]

POSITIONAL = "features"  # the one input of feature_cols, passed to the model positionally
#: A sequence input's mask's name: ``{name}`` is the input's (``data.mask_input``; a Hugging
#: Face model takes ``attention_mask``).
DEFAULT_MASK = "{name}_mask"
#: A target position a loss leaves out: padding, or a row's last position, whose next token
#: is unknown (PyTorch's and Hugging Face's ``ignore_index``).
IGNORED = -100


class InputKind(str, enum.Enum):
    MATRIX = "matrix"  # several columns -> one float32 [rows, width]
    COLUMN = "column"  # one column in its own dtype and shape
    SEQUENCE = "sequence"  # arrays of any length, padded per batch, with a mask
    IMAGE = "image"  # uint8 [rows, C, H, W] in blocks; float32 in [0, 1] in batches
    TEXT = "text"  # a string column tokenized into ids: a sequence, with a mask


@dataclass(frozen=True)
class InputSpec:
    """One named input of the model."""

    name: str
    columns: tuple[ColumnSpec, ...]
    kind: InputKind
    shape: tuple[int, ...] = ()  # per-row shape from input_shapes (COLUMN only)
    text: Tokenization | None = None  # the tokenizer (TEXT only)

    @property
    def described(self) -> str:
        names = [c.name for c in self.columns]
        if self.kind is InputKind.MATRIX:
            return f"input {self.name!r} (columns {names})"
        return f"input {self.name!r} (column {names[0]!r})"


@dataclass(frozen=True)
class DataPlan:
    """How every record batch of a fit (or a transform) becomes a block.

    Attributes:
        inputs: the decoded inputs, in the order the model sees them.
        label, label_kind: the target column and what the loss needs of it.
        weight: the per-row weight column, if any.
        keyword: call ``model(**inputs)``; False: ``model(x)`` with the one input.
        transform_fn: the user's decoder, run on the executors, or None.
        extra_columns: columns shipped only for ``transform_fn``.
        max_sequence_length: sequences longer than this keep their first values (0: no cap).
        cache_transformed: cache transform_fn's output after epoch 1 instead of re-running it.
        validation_col: a boolean column whose true rows are held out to validate, or None.
        not_inputs: names transform_fn may return that never reach the model (at inference:
            the label and weight, which it returns when the rows have them, as in training).
        mask_input: the name of a sequence input's mask, ``{name}`` standing for the input's.
        next_token_of: the input whose next tokens are the targets (``loss_fn = "causal_lm"``:
            no label column; :func:`sparkdl.data.tensors.to_batch` makes them); "" for none.
        pad_to_max_length: pad every sequence to ``max_sequence_length``, not to its batch's
            longest row (one shape for every batch).
    """

    inputs: tuple[InputSpec, ...]
    label: ColumnSpec | None = None
    label_kind: LabelKind = LabelKind.REAL
    weight: ColumnSpec | None = None
    keyword: bool = False
    transform_fn: TransformFn | None = None
    extra_columns: tuple[str, ...] = ()
    max_sequence_length: int = 0
    cache_transformed: bool = False
    validation_col: str | None = None
    _takes_training: bool = field(default=False, repr=False)
    not_inputs: tuple[str, ...] = ()
    mask_input: str = DEFAULT_MASK
    next_token_of: str = ""
    pad_to_max_length: bool = False

    def mask_name(self, name: str) -> str:
        """The name of sequence input ``name``'s mask, as the model takes it."""
        return mask_name(self.mask_input, name)

    @property
    def masks(self) -> frozenset[str]:
        """The names of every sequence input's mask."""
        ragged = (InputKind.SEQUENCE, InputKind.TEXT)
        return frozenset(self.mask_name(s.name) for s in self.inputs if s.kind in ragged)

    @property
    def column_names(self) -> list[str]:
        """Every column the executors need, each once, in a stable order."""
        names = [c.name for spec in self.inputs for c in spec.columns]
        names += [c.name for c in (self.label, self.weight) if c is not None]
        names += list(self.extra_columns)
        names += [self.validation_col] if self.validation_col else []
        return list(dict.fromkeys(names))

    @functools.cached_property
    def image_inputs(self) -> frozenset[str]:
        """The inputs that are images (uint8 in blocks, float32 in [0, 1] in batches)."""
        return frozenset(spec.name for spec in self.inputs if spec.kind is InputKind.IMAGE)

    @functools.cached_property
    def pad_ids(self) -> dict[str, int]:
        """The padding id of each text input (other sequences pad with 0)."""
        return {s.name: s.text.pad_id for s in self.inputs if s.text is not None}

    @property
    def features(self) -> tuple[ColumnSpec, ...]:
        """The columns of every input (what the preflight names when something does not fit)."""
        return tuple(c for spec in self.inputs for c in spec.columns)

    @property
    def transforms_every_epoch(self) -> bool:
        """Whether the epoch cache must hold raw rows (transform_fn re-runs every epoch)."""
        return self.transform_fn is not None and not self.cache_transformed

    def for_inference(self) -> DataPlan:
        """The same inputs, without label, weight or validation column."""
        return replace(self, label=None, weight=None, validation_col=None, next_token_of="")

    def describe_inputs(self) -> str:
        """The inputs in the user's terms, e.g. "the feature columns ['x']"."""
        if not self.keyword:
            return f"the feature columns {[c.name for c in self.features]}"
        parts = [spec.described for spec in self.inputs]
        if self.transform_fn is not None:
            parts.append("the outputs of transform_fn")
        return ", ".join(parts)


def _weight_spec(schema: pa.Schema, weight_col: str) -> ColumnSpec:
    weight = ColumnSpec(weight_col, kind_of_arrow_type(weight_col, schema.field(weight_col).type))
    if weight.kind is not ColumnKind.SCALAR:
        raise SchemaError(
            f"weight column {weight_col!r} has type {schema.field(weight_col).type}; use a number"
        )
    return weight


def _check_validation_column(schema: pa.Schema, validation_col: str) -> None:
    _require_columns(schema, [validation_col])
    if not pa.types.is_boolean(schema.field(validation_col).type):
        raise SchemaError(
            f"validation column {validation_col!r} has type {schema.field(validation_col).type}; "
            "it must be boolean (true: the row validates)"
        )


def plan_data(
    schema: pa.Schema,
    *,
    feature_cols: tuple[str, ...] = (),
    inputs: Mapping[str, str | tuple[str, ...] | list[str]] | None = None,
    input_shapes: Mapping[str, tuple[int, ...] | list[int]] | None = None,
    sequence_cols: tuple[str, ...] = (),
    max_sequence_length: int = 0,
    label_col: str | None = None,
    label_kind: LabelKind = LabelKind.REAL,
    weight_col: str | None = None,
    transform_fn: TransformFn | None = None,
    cache_transformed: bool = False,
    validation_col: str | None = None,
    not_inputs: tuple[str, ...] = (),
    mask_input: str = DEFAULT_MASK,
    next_token_of: str = "",
    tokenizer: Tokenization | None = None,
    pad_to_max_length: bool = False,
) -> DataPlan:
    """Check the columns against ``schema`` and decide how each is decoded.

    Args:
        tokenizer: tokenizes every input of one string column (``data.tokenizer``).

    Raises:
        SchemaError: a missing column, a type no input can take, an input_shapes or
            sequence_cols entry that names no single-column input, a name clash, a tokenizer
            with no text input.
    """
    inputs = dict(inputs or {})
    shapes: dict[str, tuple[int, ...]] = {k: tuple(v) for k, v in (input_shapes or {}).items()}
    keyword = bool(inputs) or transform_fn is not None
    if not keyword:
        inputs = {POSITIONAL: tuple(feature_cols)}
    wanted = [c for v in inputs.values() for c in ([v] if isinstance(v, str) else v)]
    wanted += [c for c in (label_col, weight_col) if c]
    _require_columns(schema, wanted)
    specs = tuple(
        _input_spec(schema, name, source, shapes.get(name, ()), sequence_cols, keyword, tokenizer)
        for name, source in inputs.items()
    )
    if tokenizer is not None and not any(s.kind is InputKind.TEXT for s in specs):
        raise SchemaError(
            f"data.tokenizer = {tokenizer.source!r} tokenizes string columns, but no input is one: "
            f"the inputs are {[(s.name, s.kind.value) for s in specs]}. Feed the text column as an "
            "input of its own (inputs={'input_ids': 'text'}), or unset data.tokenizer"
        )
    _check_names(specs, shapes, sequence_cols, label_col, weight_col, mask_input)
    if next_token_of:
        _check_token_input(specs, next_token_of)
    label = _label_spec(schema, label_col, label_kind) if label_col else None
    weight = _weight_spec(schema, weight_col) if weight_col else None
    if validation_col:
        _check_validation_column(schema, validation_col)
    used = {c.name for s in specs for c in s.columns} | {label_col, weight_col, validation_col}
    extra = tuple(n for n in schema.names if n not in used) if transform_fn is not None else ()
    return DataPlan(
        specs,
        label,
        label_kind,
        weight,
        keyword,
        transform_fn,
        extra,
        max_sequence_length,
        cache_transformed,
        validation_col or None,
        _takes_training=transform_fn is not None and _takes_training(transform_fn),
        not_inputs=tuple(n for n in not_inputs if n),
        mask_input=mask_input,
        next_token_of=next_token_of,
        pad_to_max_length=pad_to_max_length,
    )


def _require_columns(schema: pa.Schema, names: list[str]) -> None:
    missing = [c for c in dict.fromkeys(names) if c not in schema.names]
    if missing:
        raise SchemaError(
            f"column(s) {missing} not found; the DataFrame has {schema.names}. "
            "Set feature_cols / inputs / label_col / weight_col to existing columns"
        )


def _input_spec(
    schema: pa.Schema,
    name: str,
    source: str | tuple[str, ...] | list[str],
    shape: tuple[int, ...],
    sequence_cols: tuple[str, ...],
    keyword: bool,
    tokenizer: Tokenization | None = None,
) -> InputSpec:
    columns = [source] if isinstance(source, str) else list(source)
    if not columns:
        raise SchemaError(f"input {name!r} names no column; give it a column or a list of columns")
    specs = tuple(ColumnSpec(c, kind_of_arrow_type(c, schema.field(c).type)) for c in columns)
    if isinstance(source, str):
        spec = specs[0]
        typ = schema.field(spec.name).type
        if tokenizer is not None and is_text(typ):
            return InputSpec(name, specs, InputKind.TEXT, text=tokenizer)
        if spec.kind is ColumnKind.BYTES:
            text = " (or set data.tokenizer to a tokenizer.json)" if is_text(typ) else ""
            raise SchemaError(
                f"column {spec.name!r} ({typ}) cannot feed input {name!r} as it is: "
                f"decode it in transform_fn (e.g. image bytes -> pixels, text -> token ids){text}"
            )
        if spec.name in sequence_cols:
            if spec.kind is not ColumnKind.ARRAY:  # refused here, on the driver, not by every worker
                raise SchemaError(
                    f"sequence column {spec.name!r} must be an array of numbers, not "
                    f"{schema.field(spec.name).type}; remove it from sequence_cols"
                )
            return InputSpec(name, specs, InputKind.SEQUENCE)
        if spec.kind is ColumnKind.IMAGE:
            return InputSpec(name, specs, InputKind.IMAGE)
        return InputSpec(name, specs, InputKind.COLUMN, shape)
    flat_only = (ColumnKind.SCALAR, ColumnKind.ARRAY, ColumnKind.VECTOR)
    for spec in specs:
        if spec.kind not in flat_only:
            where = f"input {name!r}" if keyword else "feature_cols"
            raise SchemaError(
                f"column {spec.name!r} ({schema.field(spec.name).type}) cannot join the float32 matrix "
                f"of {where}: only numbers, arrays of numbers and ml Vectors concatenate; give it "
                "an input of its own (inputs={'name': 'column'})"
                + (" or decode it in transform_fn" if spec.kind is ColumnKind.BYTES else "")
            )
    return InputSpec(name, specs, InputKind.MATRIX)


def _check_names(
    specs: tuple[InputSpec, ...],
    input_shapes: Mapping[str, tuple[int, ...]],
    sequence_cols: tuple[str, ...],
    label_col: str | None,
    weight_col: str | None,
    mask_input: str = DEFAULT_MASK,
) -> None:
    names = {s.name for s in specs}
    single = {s.name for s in specs if s.kind is InputKind.COLUMN}
    odd_shapes = sorted(set(input_shapes) - single)
    if odd_shapes:
        raise SchemaError(
            f"input_shapes names {odd_shapes}, which are not single-column inputs ({sorted(single)}); "
            "input_shapes reshapes an input of one array column, by the input's name"
        )
    columns_of_one = {
        s.columns[0].name for s in specs if len(s.columns) == 1 and s.kind is not InputKind.MATRIX
    }
    odd_sequences = sorted(set(sequence_cols) - columns_of_one)
    if odd_sequences:
        raise SchemaError(
            f"sequence_cols names {odd_sequences}, which no input feeds alone; a sequence column "
            "must be an input of its own (inputs={'tokens': 'tokens'})"
        )
    sequences = [s.name for s in specs if s.kind in (InputKind.SEQUENCE, InputKind.TEXT)]
    masks = [mask_name(mask_input, name) for name in sequences]
    if len(set(masks)) < len(masks):
        raise SchemaError(
            f"data.mask_input = {mask_input!r} gives the masks of the sequence inputs {sequences} "
            f"one name ({masks[0]!r}); put {{name}} in it (e.g. '{{name}}_mask'), or feed one sequence"
        )
    for name, mask in zip(sequences, masks, strict=True):
        if mask in names:
            raise SchemaError(
                f"input {mask!r} clashes with the mask of sequence input {name!r} "
                f"(data.mask_input = {mask_input!r}); rename one"
            )
    for spec in specs:
        for column in spec.columns:
            if column.name in (label_col, weight_col):
                raise SchemaError(
                    f"column {column.name!r} is both a model input ({spec.name!r}) and the "
                    f"{'label' if column.name == label_col else 'weight'} column; a model must not see it"
                )


def _check_token_input(specs: tuple[InputSpec, ...], name: str) -> None:
    """Refuse a ``causal_lm`` input that is not one column of integer token ids."""
    spec = next((s for s in specs if s.name == name), None)
    one_array = spec is not None and len(spec.columns) == 1 and spec.columns[0].kind is ColumnKind.ARRAY
    if spec is not None and spec.kind is InputKind.TEXT:
        return
    if spec is None or spec.kind not in (InputKind.SEQUENCE, InputKind.COLUMN) or not one_array:
        raise SchemaError(
            f"loss_fn = 'causal_lm' trains on the next token of input {name!r}, which must be one "
            "array<int> column of token ids (list it in sequence_cols when rows differ in length) "
            "or a string column with data.tokenizer; "
            f"the inputs are {[(s.name, s.kind.value) for s in specs]}"
        )


def mask_name(mask_input: str, name: str) -> str:
    """``mask_input`` with ``{name}`` replaced by the sequence input's name (any other text
    kept as it is: ``attention_mask`` names every mask alike)."""
    return mask_input.replace("{name}", name)


def _label_spec(schema: pa.Schema, label_col: str, label_kind: LabelKind) -> ColumnSpec:
    typ = schema.field(label_col).type
    kind = kind_of_arrow_type(label_col, typ)
    if kind not in (ColumnKind.SCALAR, ColumnKind.ARRAY):  # class ids: one per row, or per position
        raise SchemaError(
            f"label column {label_col!r} has type {typ}; a {label_kind.value} label must be a numeric "
            "column or an array of numbers"
        )
    return ColumnSpec(label_col, kind)


def _takes_training(fn: TransformFn) -> bool:
    try:
        return "training" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------- decoding
