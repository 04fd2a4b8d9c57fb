"""KV caches for Gemma 4 (MLX arrays live in unified memory on Apple silicon).

We reuse mlx-lm's cache classes, which fit Gemma 4 exactly:

* sliding layers: ``RotatingKVCache(max_size=sliding_window)``, a ring buffer. During a multi-token
  chunk it briefly holds ``window - 1`` old tokens plus the chunk, so every query sees its full window;
* full layers: ``KVCache``, which grows in steps of 256 tokens;
* KV-shared layers (the last ``num_kv_shared_layers`` of E2B/E4B): no cache at all; they attend
  over the K/V their source layer just returned from its cache.
"""

from __future__ import annotations

from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..config import TextConfig


def make_cache(cfg: TextConfig) -> list:
    """One cache per layer that owns K/V (KV-shared layers come last and get none)."""
    caches = []
    for spec in cfg.layers:
        if spec.is_kv_shared:
            continue
        caches.append(RotatingKVCache(max_size=cfg.sliding_window) if spec.is_sliding else KVCache())
    return caches
