"""The one seam for fast paths: attention, RMSNorm tails, RoPE, GeGLU and the MoE experts.

Every model module calls these functions rather than MLX directly, so that a custom kernel (Metal or
CUDA), a compiled fusion or a blockwise long-context path plugs in here, once, for every variant.
Each op has a reference implementation, a composition of MLX's own ops (:mod:`.reference`), which is
what runs unless a faster one is registered for the current device with :func:`register`.
``GEMMA4_MLX_REFERENCE_OPS=1`` in the environment forces the reference path everywhere (to compare,
or to rule out a kernel when something looks wrong).
"""

from __future__ import annotations

import os
from typing import Callable

import mlx.core as mx

from . import compiled as _compiled_functions
from . import reference
from .derived_keys import DerivedKeys

REFERENCE_ONLY = os.environ.get("GEMMA4_MLX_REFERENCE_OPS", "").strip() not in ("", "0")

# name -> {device type: implementation}; filled by kernel modules as they are added.
_FAST: dict[str, dict[mx.DeviceType, Callable]] = {}
_chosen: dict[tuple[str, mx.DeviceType], Callable] = {}


def register(name: str, device_type: mx.DeviceType, fn: Callable) -> None:
    """Use ``fn`` for op ``name`` on devices of ``device_type`` (same signature as the reference)."""
    if not hasattr(reference, name):
        raise ValueError(f"no op named {name!r} (ops: {', '.join(OPS)})")
    _FAST.setdefault(name, {})[device_type] = fn
    _chosen.clear()
    invalidate_compiled()


def invalidate_compiled() -> None:
    """Make functions compiled over the ops trace again on their next call (after a change to what
    the ops call, e.g. a kernel registered or a measuring tool's stand-ins)."""
    _compiled_functions.reset()


def implementation(name: str) -> Callable:
    """The implementation of op ``name`` for the current default device."""
    if not _FAST or REFERENCE_ONLY:  # nothing registered: skip the device lookup (once per op call)
        return getattr(reference, name)
    key = (name, mx.default_device().type)
    fn = _chosen.get(key)
    if fn is None:
        fast = None if REFERENCE_ONLY else _FAST.get(name, {}).get(key[1])
        fn = _chosen[key] = fast or getattr(reference, name)
    return fn


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask) -> mx.array:
    """Scaled dot-product attention, q [B, H, L, D], k/v [B, KV, S, D] (any GQA ratio) or a quantized
    cache's ``(packed, scales, biases)`` triples, or (a K=V layer's cache) ``k`` a
    :class:`~.derived_keys.DerivedKeys` made from ``v``; ``mask`` is None, "causal" or a boolean/additive
    array broadcastable to [B, H, L, S]."""
    return implementation("attention")(q, k, v, scale, mask)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """RMSNorm over the last axis, scaled by ``weight`` (None: unscaled)."""
    return implementation("rms_norm")(x, weight, eps)


def add_rms_norm(residual: mx.array, x: mx.array, weight: mx.array, eps: float, scalar: mx.array | None = None) -> mx.array:
    """The tail of a sandwich-norm block: ``(residual + rms_norm(x) * weight) * scalar``."""
    return implementation("add_rms_norm")(residual, x, weight, eps, scalar)


def rope(x: mx.array, offset, rope_module) -> mx.array:
    """Rotary position embedding of x [B, H, L, D] at ``offset``, by a layer's RoPE module (mlx-lm's
    ``initialize_rope``: default or proportional)."""
    return implementation("rope")(x, offset, rope_module)


def geglu(gate: mx.array, up: mx.array) -> mx.array:
    """``gelu_tanh(gate) * up``."""
    return implementation("geglu")(gate, up)


def moe_experts(x: mx.array, indices: mx.array, weights: mx.array, switch_glu) -> mx.array:
    """The routed experts of each token: ``sum_k weights[k] * expert_{indices[k]}(x)``."""
    return implementation("moe_experts")(x, indices, weights, switch_glu)


OPS = ("attention", "rms_norm", "add_rms_norm", "rope", "geglu", "moe_experts")

__all__ = ["register", "implementation", "invalidate_compiled", "DerivedKeys", "REFERENCE_ONLY", *OPS]
