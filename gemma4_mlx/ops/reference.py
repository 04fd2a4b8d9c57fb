"""The reference implementations of the ops: compositions of MLX's own ops (its fused ``mx.fast``
kernels where they exist). They define what every faster implementation must compute."""

from __future__ import annotations


import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from . import blockwise
from .derived_keys import DerivedKeys, dense_values
from .compiled import compiled


def attention(q, k, v, scale, mask):
    if isinstance(k, DerivedKeys):
        return derived_keys_attention(q, k, v, scale, mask)
    # Quantized caches hand over (packed, scales, biases) triples; MLX's fused attention takes arrays.
    direct = quantized_attention if isinstance(k, (tuple, list)) else mx.fast.scaled_dot_product_attention
    # A long chunk's scores beyond the budget: computed in query blocks (see blockwise.py).
    if q.shape[2] > 1 and blockwise.scores_bytes(q, k) > blockwise.SCORES_BUDGET:
        return blockwise.attention_in_query_blocks(q, k, v, scale, mask, blockwise.query_block_size(q, k), direct)
    return direct(q, k, v, scale=scale, mask=mask)


def derived_keys_attention(q, k: DerivedKeys, v, scale, mask):
    """Attention over a K=V layer's derived keys: made all at once while they (and the values,
    dequantized if quantized) fit the scores budget, else made and read in key blocks."""
    if k.dense_bytes() <= blockwise.SCORES_BUDGET:
        return attention(q, k.block(), dense_values(v, k.head_dim), scale, mask)
    return blockwise.attention_over_key_blocks(q, k, v, scale, mask, blockwise.key_block_size(q, k))


def quantized_attention(q, k, v, scale, mask=None):
    """Attention over quantized keys and values (mlx-lm's quantized matmuls); the bits and group
    size are read from the shapes: ``D * bits / 32`` packed words and ``D / group`` scales."""
    D = q.shape[-1]
    bits = k[0].shape[-1] * 32 // D
    group_size = D // k[1].shape[-1]
    # Scaled here: mlx-lm's function scales its queries in place (``queries *= scale``), which would
    # change the caller's array.
    return quantized_scaled_dot_product_attention(q * scale, k, v, scale=1.0, mask=mask, group_size=group_size, bits=bits)


def rms_norm(x, weight, eps):
    return mx.fast.rms_norm(x, weight, eps)


def add_rms_norm(residual, x, weight, eps, scalar):
    out = residual + mx.fast.rms_norm(x, weight, eps)
    return out if scalar is None else out * scalar


def rope(x, offset, rope_module):
    return rope_module(x, offset=offset)


@compiled(shapeless=True)
def geglu(gate, up):
    return nn.gelu_approx(gate) * up


def moe_experts(x, indices, weights, switch_glu):
    y = switch_glu(x, indices)
    return (y * weights[..., None]).sum(axis=-2).astype(x.dtype)
