"""Attention in query blocks, so that a long prefill never holds all its attention scores at once.

Without a fused kernel for its head size (MLX's CPU backend always; Metal for Gemma 4's 512-wide
full-attention heads), ``mx.fast.scaled_dot_product_attention`` materialises the scores of every query
against every key: a 2048-token chunk over 256K cached keys with 32 heads is 68 GB in float32. Cut
into query blocks sized to a budget, each block's scores are computed, used and freed before the
next: peak memory is the budget, whatever the context. Every query still sees all its keys in one
softmax, so the result is what the direct call gives (up to float rounding of smaller matmuls).

A K=V layer's derived keys (:mod:`.derived_keys`) too long to make at once are made and read in key
blocks instead, combined by an online softmax (:func:`attention_over_key_blocks`).

Written here because MLX has no memory-bounded attention for head sizes its fused kernels lack.
"""

from __future__ import annotations

import os

import mlx.core as mx
from mlx.utils import tree_map

from .derived_keys import DerivedKeys, dense_values

# Bytes of float32 scores one attention call may hold (GEMMA4_MLX_ATTENTION_BUDGET_MB overrides).
SCORES_BUDGET = int(float(os.environ.get("GEMMA4_MLX_ATTENTION_BUDGET_MB", "512")) * 2**20)


def key_count(k) -> int:
    """Keys in ``k`` [B, KV, S, D] (or a quantized cache's ``(packed, scales, biases)`` triple, or
    :class:`~.derived_keys.DerivedKeys`)."""
    if isinstance(k, DerivedKeys):
        return k.count
    return (k[0] if isinstance(k, (tuple, list)) else k).shape[2]


def scores_bytes(q: mx.array, k) -> int:
    """Bytes of the float32 scores of ``q`` [B, H, L, D] against ``k`` [B, KV, S, D]."""
    B, H, L, _ = q.shape
    return B * H * L * key_count(k) * 4


def query_block_size(q: mx.array, k, budget: int | None = None) -> int:
    """Queries per block so that one block's scores fit ``budget`` (default :data:`SCORES_BUDGET`;
    at least one query)."""
    B, H, _, _ = q.shape
    budget = SCORES_BUDGET if budget is None else budget
    return max(1, budget // max(1, B * H * key_count(k) * 4))


def attention_in_query_blocks(q, k, v, scale: float, mask, block: int, attend=mx.fast.scaled_dot_product_attention) -> mx.array:
    """``attend(q, k, v, scale=scale, mask=mask)`` (MLX's attention, or the quantized one for
    quantized triples) computed ``block`` queries at a time. ``mask``: None, "causal" (queries are
    the last L positions, as MLX aligns them) or an array broadcastable to [B, H, L, S]. With
    "causal", each block also reads only the keys it can see."""
    L, S = q.shape[2], key_count(k)
    outs = []
    for start in range(0, L, block):
        end = min(L, start + block)
        qb = q[:, :, start:end]
        if outs:
            # Each block waits for the one before, so MLX frees a block's scores before it makes the
            # next one's (left to itself it schedules all blocks' score matmuls first). Lazy: no sync.
            qb = mx.depends(qb, outs[-1])
        if mask is None:
            out = attend(qb, k, v, scale=scale, mask=None)
        elif isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"unknown attention mask {mask!r}")
            visible = S - L + end  # the block's last query is at key position visible - 1
            kb, vb = tree_map(lambda a: a[:, :, :visible], (k, v))
            out = attend(qb, kb, vb, scale=scale, mask="causal")
        else:
            mb = mask[..., start:end, :] if mask.ndim >= 2 and mask.shape[-2] == L else mask
            out = attend(qb, k, v, scale=scale, mask=mb)
        outs.append(out)
    return mx.concatenate(outs, axis=2)


def key_block_size(q: mx.array, keys: DerivedKeys, budget: int | None = None) -> int:
    """Keys per block so that one block's float32 scores fit ``budget`` (default
    :data:`SCORES_BUDGET`; at least one key)."""
    B, H, L, _ = q.shape
    budget = SCORES_BUDGET if budget is None else budget
    return max(1, min(keys.count, budget // max(1, B * H * L * 4)))


def attention_over_key_blocks(q: mx.array, keys: DerivedKeys, values, scale: float, mask, block: int) -> mx.array:
    """Attention of ``q`` [B, H, L, D] over derived keys made ``block`` at a time: each block's keys,
    values and scores are made, used and freed, and the blocks are combined by an online softmax (a
    running maximum and sum per query, as flash attention does), in float32. ``mask``: None,
    "causal" (queries are the last L positions) or an array broadcastable to [B, H, L, S]."""
    B, H, L, D = q.shape
    S, KV = keys.count, keys.heads
    G = H // KV
    queries = (q * scale).reshape(B, KV, G, L, D)
    masked = mx.array(mx.finfo(mx.float32).min, mx.float32)  # finite: a row masked in one block stays finite
    top = mx.full((B, KV, G, L, 1), -mx.inf, mx.float32)
    total = mx.zeros((B, KV, G, L, 1), mx.float32)
    acc = None
    query_positions = mx.arange(S - L, S)[:, None]
    for begin in range(0, S, block):
        end = min(S, begin + block)
        k = keys.block(begin, end)
        if acc is not None:
            # One block at a time (see attention_in_query_blocks), after both running sums: waiting
            # for the output alone, MLX would leave every block's sum for last, with its scores.
            k = mx.depends(k, [acc, total])
        v = dense_values(values, keys.head_dim, begin, end)[:, :, None]
        scores = (queries @ k[:, :, None].swapaxes(-1, -2)).astype(mx.float32)  # [B, KV, G, L, n]
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"unknown attention mask {mask!r}")
            scores = mx.where(mx.arange(begin, end)[None] <= query_positions, scores, masked)
        elif mask is not None:
            part = mask[..., begin:end] if mask.shape[-1] == S else mask
            part = part.reshape(*part.shape[:-3], KV, G, *part.shape[-2:]) if part.ndim == 4 and part.shape[1] == H else mx.expand_dims(part, -3)
            scores = mx.where(part, scores, masked) if part.dtype == mx.bool_ else scores + part.astype(mx.float32)
        new_top = mx.maximum(top, scores.max(axis=-1, keepdims=True))
        weights = mx.exp(scores - new_top)
        shrink = mx.exp(top - new_top)
        total = total * shrink + weights.sum(axis=-1, keepdims=True)
        part_out = (weights.astype(v.dtype) @ v).astype(mx.float32)
        acc = part_out if acc is None else acc * shrink + part_out
        top = new_top
    return (acc / total).astype(q.dtype).reshape(B, H, L, -1)


__all__ = ["attention_in_query_blocks", "attention_over_key_blocks", "query_block_size", "key_block_size", "scores_bytes", "key_count", "SCORES_BUDGET"]
