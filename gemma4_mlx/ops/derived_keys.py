"""Keys made from the values when attention reads them, so that a K=V layer's cache stores one tensor.

In the full-attention layers of the 26B and 31B (``attention_k_eq_v``) V is ``rms_norm(k_proj(x))``
without a scale, and K is ``rope(k_norm.weight * V)``: K is a function of V. Their caches
(:class:`~gemma4_mlx.models.cache.ValueOnlyKVCache`) store V alone, half the bytes, and hand attention
a :class:`DerivedKeys`, which makes the keys block by block as they are read. The product and the
rotation are the ones the layer computes for its new keys, so the keys come out the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx


def dense_values(values, head_dim: int, begin: int = 0, end: int | None = None) -> mx.array:
    """Tokens ``begin:end`` (axis 2) of ``values`` [B, KV, S, D], dequantized when they are a
    quantized cache's ``(packed, scales, biases)`` triple (bits and group size read from the shapes)."""
    if not isinstance(values, (tuple, list)):
        return values if (begin, end) == (0, None) else values[..., begin:end, :]
    packed, scales, biases = (a[..., begin:end, :] for a in values)
    bits = packed.shape[-1] * 32 // head_dim
    return mx.dequantize(packed, scales, biases, group_size=head_dim // scales.shape[-1], bits=bits)


@dataclass(frozen=True)
class DerivedKeys:
    """The keys of a K=V layer, ``rope(weight * values)`` at positions ``start, start + 1, ...``,
    made when read (:meth:`block`). ``values`` are an array [B, KV, S, D] or a quantized triple."""

    values: Any
    weight: mx.array  # the layer's k_norm weight [D]
    rope: Callable  # the layer's RoPE module (mlx-lm's), called as rope(x, offset=...)
    head_dim: int
    start: int = 0

    @property
    def _packed(self) -> mx.array:
        """The values array, or a quantized triple's packed values (same batch, heads and tokens)."""
        return self.values[0] if isinstance(self.values, (tuple, list)) else self.values

    @property
    def count(self) -> int:
        """How many keys."""
        return self._packed.shape[2]

    @property
    def heads(self) -> int:
        return self._packed.shape[1]

    @property
    def dtype(self) -> mx.Dtype:
        return (self.values[1] if isinstance(self.values, (tuple, list)) else self.values).dtype

    def block(self, begin: int = 0, end: int | None = None) -> mx.array:
        """Keys ``begin:end`` [B, KV, n, D]."""
        values = dense_values(self.values, self.head_dim, begin, end)
        return self.rope(values * self.weight, offset=self.start + begin)

    def dense_bytes(self) -> int:
        """Bytes of all the keys made at once, with the values dequantized if they are quantized."""
        one = self._packed.shape[0] * self.heads * self.count * self.head_dim * self.dtype.size
        return one * (2 if isinstance(self.values, (tuple, list)) else 1)


__all__ = ["DerivedKeys", "dense_values"]
