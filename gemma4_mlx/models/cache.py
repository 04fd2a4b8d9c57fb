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


def make_cache(cfg: TextConfig, sliding_slack: int = 0) -> list:
    """One cache per layer that owns K/V (KV-shared layers come last and get none).

    ``sliding_slack`` makes the sliding layers' ring buffers that many tokens longer than the window
    (mlx-lm's masks still limit attention to the window): speculative decoding uses one, so that a
    drafter can read the window plus the token before it, as transformers' drafters do."""
    caches = []
    for spec in cfg.layers:
        if spec.is_kv_shared:
            continue
        caches.append(RotatingKVCache(max_size=cfg.sliding_window + sliding_slack) if spec.is_sliding else KVCache())
    return caches


def trim_after_chunk(cache: list, n: int) -> None:
    """Drop the last ``n`` tokens of every layer's cache, right after a multi-token forward that
    added more than ``n`` (a speculative verify step rejecting drafted tokens).

    A full layer's cache just moves its end back. A sliding layer's ring buffer can be cut here only
    because a multi-token update leaves it in temporal order (mlx-lm keeps ``max_size - 1`` older
    tokens, then the chunk), so the rejected tokens are its last ``n`` slots; mlx-lm's own ``trim``
    refuses once the ring has wrapped."""
    if n <= 0:
        return
    for c in cache:
        if isinstance(c, RotatingKVCache):
            if c.keys is None or c._idx != c.keys.shape[2] or c._idx <= n:
                raise RuntimeError("a sliding-window cache can only be trimmed right after a longer multi-token update")
            c._idx -= n
            c.keys, c.values = c.keys[..., : c._idx, :], c.values[..., : c._idx, :]
            c.offset -= n
        else:
            c.trim(n)


def in_temporal_order(c) -> tuple:
    """A layer cache's keys and values, oldest first: views of the buffers (a ring buffer that has
    wrapped in place, after single-token steps, is reordered: a copy)."""
    if isinstance(c, RotatingKVCache):
        return c._temporal_order(c.keys), c._temporal_order(c.values)
    return c.keys_and_values()
