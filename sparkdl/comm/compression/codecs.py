"""Lossy codecs for what the strategies send, and the error feedback that makes them work.

Pure tensor code: no process groups, no sockets. Every codec turns a flat float32 tensor of
``n`` values into one flat ``uint8`` payload whose size depends on ``n`` alone
(:meth:`Codec.nbytes`, a multiple of 4), so that every worker's payload has the same size:
an all-gather can collect them (``all_gather_into_tensor``; each payload then starts at a
multiple of 4 bytes, where its float32 parts can be viewed in place) and a
parameter-server frame can carry one.

    fp16, bf16   2 bytes a value
    1bit         one sign bit a value, plus, for every chunk of 1,024 values, the mean of
                 its non-negative and the mean of its negative values (CNTK's 1-bit SGD,
                 which keeps two reconstruction values per column): n/8 + 8 n/1024 bytes,
                 1/30 of float32
    topk         the ``ratio * n`` values of largest magnitude, as (int32 index, float32
                 value) pairs: 8 k bytes

Error feedback (:class:`ErrorFeedback`). A codec alone loses information every round, and
the loss is biased (1-bit keeps signs, top-k drops the small values for ever). With error
feedback each sender keeps what it could not send and adds it to its next round:
``c_t = x_t + e_t``, sends ``E(c_t)``, keeps ``e_{t+1} = c_t - D(E(c_t))``. What arrives
over ``T`` rounds then sums to ``sum x_t - e_T``: nothing is lost, only delayed, which
is why 1-bit SGD reaches the accuracy of 32-bit (Seide et al., 2014).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Hashable

import numpy as np
import torch

from sparkdl.config.choices import Compression

_CHUNK = 1024  # values sharing one pair of 1-bit reconstruction values
_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


class Codec(abc.ABC):
    """Encodes a flat float32 tensor into a flat uint8 payload of :meth:`nbytes` bytes."""

    name: str
    code: int  # its id on the parameter server's wire (the frame's dtype field)

    @abc.abstractmethod
    def nbytes(self, numel: int) -> int:
        """The payload's size for ``numel`` values."""

    @abc.abstractmethod
    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """The payload of ``flat`` (1-D float32)."""

    @abc.abstractmethod
    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The float32 values a payload of ``numel`` values stands for."""

    def encode_and_decode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The payload of ``flat`` and the values it stands for (what error feedback needs;
        a codec may know them without decoding)."""
        payload = self.encode(flat)
        return payload, self.decode(payload, flat.numel())


class Half(Codec):
    """fp16 or bf16: half the bytes, 11 or 8 significant bits."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"
        self.code = 4 if dtype == torch.float16 else 5

    def nbytes(self, numel: int) -> int:
        return _aligned(2 * numel)

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        return _pad(flat.to(self._dtype).view(torch.uint8), self.nbytes(flat.numel()))

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return payload[: 2 * numel].view(self._dtype).float()


class OneBit(Codec):
    """Signs, and per chunk of 1,024 values the means of its non-negative and negative values."""

    name = "1bit"
    code = 2

    def nbytes(self, numel: int) -> int:
        return _aligned(8 * math.ceil(numel / _CHUNK) + math.ceil(numel / 8))

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        return self.encode_and_decode(flat)[0]

    def encode_and_decode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        numel = flat.numel()
        if numel == 0:
            return torch.zeros(0, dtype=torch.uint8, device=flat.device), flat.float()
        chunks = math.ceil(numel / _CHUNK)
        pad = chunks * _CHUNK - numel
        values = (torch.nn.functional.pad(flat, (0, pad)) if pad else flat).view(chunks, _CHUNK)
        bits = _pack_bits((values >= 0).reshape(-1)[:numel])
        up = _unpack_floats(bits, chunks * _CHUNK).view(chunks, _CHUNK)  # 1.0 where >= 0, 0.0 past the end
        ups = up.sum(1)
        downs = torch.full_like(ups, _CHUNK)
        downs[-1] -= pad
        downs -= ups
        up_sum = values.clamp(min=0).sum(1)  # the padding zeros add nothing to either sum
        means = torch.stack([up_sum / ups.clamp(min=1), (values.sum(1) - up_sum) / downs.clamp(min=1)], dim=1)
        payload = _pad(torch.cat([means.reshape(-1).view(torch.uint8), bits]), self.nbytes(numel))
        return payload, _reconstructed(up, means, numel)

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        chunks = math.ceil(numel / _CHUNK)
        means = payload[: 8 * chunks].view(torch.float32).view(chunks, 2)
        up = _unpack_floats(payload[8 * chunks :], chunks * _CHUNK).view(chunks, _CHUNK)
        return _reconstructed(up, means, numel)


def _reconstructed(up: torch.Tensor, means: torch.Tensor, numel: int) -> torch.Tensor:
    """Each value's chunk mean: the non-negative one where ``up`` is 1, the negative one where 0."""
    return torch.addcmul(means[:, 1:], up, means[:, :1] - means[:, 1:]).reshape(-1)[:numel]


class TopK(Codec):
    """The ``ratio`` of values with the largest magnitude, as (int32 index, float32 value)."""

    name = "topk"
    code = 3

    def __init__(self, ratio: float) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"topk_ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio

    def kept(self, numel: int) -> int:
        return max(1, math.ceil(self.ratio * numel)) if numel else 0

    def nbytes(self, numel: int) -> int:
        return 8 * self.kept(numel)

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        k = self.kept(flat.numel())
        index = torch.topk(flat.abs(), k, sorted=False).indices
        return torch.cat(
            [index.to(torch.int32).view(torch.uint8), flat[index].contiguous().view(torch.uint8)]
        )

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """Raises:
        ValueError: an index outside ``[0, numel)`` (a negative one would count from the end)."""
        k = self.kept(numel)
        index = payload[: 4 * k].view(torch.int32).long()
        values = payload[4 * k :].view(torch.float32)
        if k:
            low, high = (int(end) for end in torch.aminmax(index))
            if low < 0 or high >= numel:
                raise ValueError(f"top-k indices from {low} to {high}, outside [0, {numel})")
        return torch.zeros(numel, dtype=torch.float32, device=payload.device).index_put_((index,), values)


def codec_for(compression: Compression, topk_ratio: float = 0.01) -> Codec | None:
    """The codec of a ``compression`` setting (None for none, and for PowerSGD, which is
    PyTorch's own hook rather than a codec)."""
    if compression is Compression.FP16:
        return Half(torch.float16)
    if compression is Compression.BF16:
        return Half(torch.bfloat16)
    if compression is Compression.ONEBIT:
        return OneBit()
    if compression is Compression.TOPK:
        return TopK(topk_ratio)
    return None


def push_codecs(topk_ratio: float) -> tuple[Codec, ...]:
    """Every codec a parameter-server push may use (the server decodes by the frame's code)."""
    return Half(torch.float16), Half(torch.bfloat16), OneBit(), TopK(topk_ratio)


class ErrorFeedback:
    """A sender's memory of what compression lost, one residual per stream (``key``).

    Args:
        codec: how values are compressed.
        enabled: False sends ``E(x_t)`` and forgets the loss (only to show what it costs).
    """

    def __init__(self, codec: Codec, enabled: bool = True) -> None:
        self.codec = codec
        self.enabled = enabled
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def encode(self, key: Hashable, flat: torch.Tensor) -> torch.Tensor:
        """The payload for ``flat`` plus this stream's residual; the new residual is kept.

        A stream whose size changed (DDP rebuilds its buckets after the first step) starts
        with no residual.
        """
        flat = flat.detach().reshape(-1).float()
        if not self.enabled:
            return self.codec.encode(flat)
        residual = self._residuals.get(key)
        corrected = flat if residual is None or residual.numel() != flat.numel() else flat + residual
        payload, decoded = self.codec.encode_and_decode(corrected)
        self._residuals[key] = corrected.sub_(decoded) if corrected is not flat else corrected - decoded
        return payload

    def residual_norm(self) -> float:
        """The size of what is still owed, over every stream (for tests and figures)."""
        return math.sqrt(sum(float(r.pow(2).sum()) for r in self._residuals.values()))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 4) * 4


def _pad(payload: torch.Tensor, nbytes: int) -> torch.Tensor:
    if payload.numel() == nbytes:
        return payload
    return torch.cat(
        [payload, torch.zeros(nbytes - payload.numel(), dtype=torch.uint8, device=payload.device)]
    )


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Booleans, eight to a byte, the first in the highest bit (numpy's packbits on CPU)."""
    if bits.device.type == "cpu":
        return torch.from_numpy(np.packbits(bits.numpy()))
    padded = torch.zeros(math.ceil(bits.numel() / 8) * 8, dtype=torch.uint8, device=bits.device)
    padded[: bits.numel()] = bits
    return (padded.view(-1, 8) * _BIT_WEIGHTS.to(bits.device)).sum(1, dtype=torch.uint8)


def _unpack_floats(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` bits of ``packed`` as float32 ones and zeros (zeros past its end)."""
    if packed.device.type == "cpu":
        bits = torch.from_numpy(np.unpackbits(packed.numpy(), count=min(numel, 8 * packed.numel())))
    else:
        bits = packed.unsqueeze(1).bitwise_and(_BIT_WEIGHTS.to(packed.device)).ne(0).reshape(-1)[:numel]
    out = torch.zeros(numel, dtype=torch.float32, device=packed.device)
    out[: bits.numel()] = bits
    return out
