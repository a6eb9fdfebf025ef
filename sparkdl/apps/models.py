"""Small ready-made models for the bundled jobs and examples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MLPFactory:
    """A picklable ``model_fn`` building a multi-layer perceptron.

    Args:
        input_dim: number of input features.
        hidden: sizes of the hidden layers.
        output_dim: number of outputs (classes for a classifier).
        dropout: dropout after each hidden layer (0 disables).
    """

    input_dim: int
    hidden: Sequence[int]
    output_dim: int
    dropout: float = 0.0

    def __call__(self) -> nn.Module:
        layers: list[nn.Module] = []
        width = self.input_dim
        for size in self.hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            if self.dropout:
                layers.append(nn.Dropout(self.dropout))
            width = size
        layers.append(nn.Linear(width, self.output_dim))
        return nn.Sequential(*layers)


@dataclass(frozen=True)
class CausalLMFactory:
    """A picklable ``model_fn`` building a small decoder-only transformer language model.

    It takes ``tokens``, int64 ``[N, T]`` (an ``array<int>`` column, ``T <= context``), and
    returns the next token's logits at every position, ``[N, T, vocab_size]``: train it with
    ``loss_fn = "cross_entropy"`` on a label column of the next ids (the same rows shifted by
    one), and its held-out perplexity is ``exp(val_loss)``.

    Args:
        vocab_size: number of token ids.
        context: the longest sequence it reads (its learned positions).
        dim: width of the embeddings and the blocks.
        layers: number of transformer blocks (pre-norm, causal self-attention).
        heads: attention heads per block.
    """

    vocab_size: int
    context: int
    dim: int = 128
    layers: int = 2
    heads: int = 4

    def __call__(self) -> nn.Module:
        return CausalLM(self.vocab_size, self.context, self.dim, self.layers, self.heads)


class CausalLM(nn.Module):
    """Token and position embeddings, ``layers`` causal pre-norm blocks, a norm and the head
    (see :class:`CausalLMFactory`). The causal mask is made per call: a mask buffer would be
    averaged and saved with the weights."""

    def __init__(self, vocab_size: int, context: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.position = nn.Embedding(context, dim)
        block = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position.weight[:length]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device, dtype=x.dtype)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))
