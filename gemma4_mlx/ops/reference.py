"""The reference implementations of the ops: compositions of MLX's own ops (its fused ``mx.fast``
kernels where they exist). They define what every faster implementation must compute."""

from __future__ import annotations


import mlx.core as mx
import mlx.nn as nn

from . import blockwise
from .compiled import compiled


def attention(q, k, v, scale, mask):
    # A long chunk's scores beyond the budget: computed in query blocks (see blockwise.py).
    if q.shape[2] > 1 and blockwise.scores_bytes(q, k) > blockwise.SCORES_BUDGET:
        return blockwise.attention_in_query_blocks(q, k, v, scale, mask, blockwise.query_block_size(q, k))
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


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
