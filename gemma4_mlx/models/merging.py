"""Projections that read the same input, merged into one matmul after loading.

q/k/v read the same normed hidden state, as do gate/up (dense and routed experts). One matmul over
the concatenated output rows is one kernel instead of two or three per layer, and computes each
output element exactly as the separate matmuls do (an output row's dot product does not depend on
its neighbours), so values are unchanged. Quantized rows concatenate with their own scales and
biases. The checkpoint keeps the separate names: merging happens on a loaded model
(:meth:`gemma4_mlx.models.gemma4.Gemma4Model.merge_projections`), never on disk.

Written here because neither MLX nor mlx-lm has a merge for loaded (possibly quantized) linears.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

_ARRAYS = ("weight", "scales", "biases", "bias")
_QUANTIZATION = ("group_size", "bits", "mode")


def can_merge(modules: list[nn.Module]) -> bool:
    """True when ``modules`` are linears of one kind (plain, quantized, per-expert) with the same
    quantization, dtypes and input width: their rows can be stacked."""
    first = modules[0]
    same_type = all(type(m) is type(first) for m in modules)
    same_arrays = all(sorted(k for k in _ARRAYS if k in m) == sorted(k for k in _ARRAYS if k in first) for m in modules)
    # A global scale (nvfp4 experts) is per module: rows under different ones cannot share a matmul.
    if not (same_type and same_arrays) or any(getattr(m, "global_scale", None) is not None for m in modules):
        return False
    quant = [tuple(getattr(m, q, None) for q in _QUANTIZATION) for m in modules]
    shapes = {k: [(m[k].shape[:-2], m[k].shape[-1], m[k].dtype) for m in modules] for k in _ARRAYS if k in first and k != "bias"}
    return len(set(quant)) == 1 and all(len(set(v)) == 1 for v in shapes.values())


def merge(modules: list[nn.Module]) -> nn.Module:
    """One module of ``modules``' kind whose output is their outputs concatenated on the last axis.

    The first module is reused (it keeps its quantization settings) with its arrays replaced by the
    concatenated ones; the others are left as they are for the caller to drop."""
    if not can_merge(modules):
        raise ValueError("these projections cannot be merged (different kinds, quantization or input widths)")
    merged = modules[0]
    for key in _ARRAYS:
        if key in merged:
            # Output rows are the second-to-last axis of weights, scales and quantization biases
            # ([out, in] or [experts, out, in]); the last axis of a bias.
            axis = -1 if key == "bias" else -2
            setattr(merged, key, mx.concatenate([m[key] for m in modules], axis=axis))
    return merged


__all__ = ["can_merge", "merge"]
