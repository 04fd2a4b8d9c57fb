"""KV caches for Gemma 4 (MLX arrays live in unified memory on Apple silicon).

We reuse mlx-lm's cache classes, which fit Gemma 4 exactly:

* sliding layers: ``RotatingKVCache(max_size=sliding_window)``, a ring buffer. During a multi-token
  chunk it briefly holds ``window - 1`` old tokens plus the chunk, so every query sees its full window;
* full layers: ``KVCache``, which grows in steps of 256 tokens;
* K=V full layers (26B/31B): :class:`ValueOnlyKVCache`, which stores V alone; its keys are a
  function of V, made when attention reads them (:class:`~gemma4_mlx.ops.DerivedKeys`): half the
  bytes of those layers' caches, which hold most of a long context;
* KV-shared layers (the last ``num_kv_shared_layers`` of E2B/E4B): no cache at all; they attend
  over the K/V their source layer just returned from its cache.

With ``kv_bits`` the caches store keys and values quantized (MLX's affine quantization, a scale and
a bias per ``kv_group_size`` values): mlx-lm's ``QuantizedKVCache`` for full layers and
:class:`QuantizedRotatingKVCache` for sliding ones. They return ``(packed, scales, biases)`` triples,
which :func:`gemma4_mlx.ops.attention` takes in place of arrays. 8 bits per value is 0.53x the bf16
bytes at group size 64, 4 bits 0.28x.
"""

from __future__ import annotations

import copy
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, _BaseCache, create_attention_mask

from ..config import TextConfig
from ..errors import OptionError

KV_BITS = (2, 3, 4, 5, 6, 8)  # MLX's affine quantization
KV_GROUP_SIZES = (32, 64, 128)


class QuantizedRotatingKVCache(_BaseCache):
    """A sliding layer's ring buffer holding quantized keys and values.

    Written here because mlx-lm has none (its ``RotatingKVCache.to_quantized`` raises, which is why
    mlx-lm's ``--kv-bits`` fails on Gemma 4). The ring logic stays mlx-lm's: three
    ``RotatingKVCache`` rings, for the packed values, the scales and the biases, move in step, since
    a ring only ever moves whole tokens along axis 2."""

    def __init__(self, max_size: int, group_size: int = 64, bits: int = 8):
        self.group_size, self.bits = group_size, bits
        self.max_size = max_size
        self.rings = [RotatingKVCache(max_size=max_size) for _ in range(3)]

    def update_and_fetch(self, keys, values):
        keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        fetched = [ring.update_and_fetch(k, v) for ring, k, v in zip(self.rings, keys, values)]
        return tuple(k for k, _ in fetched), tuple(v for _, v in fetched)

    @property
    def offset(self) -> int:
        return self.rings[0].offset

    @property
    def keys(self):
        return None if self.rings[0].keys is None else tuple(r.keys for r in self.rings)

    @property
    def values(self):
        return None if self.rings[0].values is None else tuple(r.values for r in self.rings)

    def keys_and_values(self):
        fetched = [r.keys_and_values() for r in self.rings]
        return tuple(k for k, _ in fetched), tuple(v for _, v in fetched)

    def temporal_order(self):
        """Keys and values oldest first (see :func:`in_temporal_order`)."""
        ordered = [(r._temporal_order(r.keys), r._temporal_order(r.values)) for r in self.rings]
        return tuple(k for k, _ in ordered), tuple(v for _, v in ordered)

    @property
    def state(self):
        return [r.state for r in self.rings]

    def size(self):
        return self.rings[0].size()

    def is_trimmable(self):
        return self.rings[0].is_trimmable()

    def trim(self, n):
        return [r.trim(n) for r in self.rings][0]

    def make_mask(self, *args, **kwargs):
        return self.rings[0].make_mask(*args, **kwargs)

    def empty(self):
        return self.rings[0].keys is None

    @property
    def nbytes(self):
        return sum(r.nbytes for r in self.rings)


class _TrimmableCache(_BaseCache):
    """A cache whose length is its ``offset`` and that trims by moving it back (mlx-lm's ``KVCache`` rule)."""

    offset = 0

    def size(self):
        return self.offset

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, n)
        self.offset -= n
        return n


class ValueOnlyKVCache(_TrimmableCache):
    """A K=V layer's cache: it stores the values alone (exact, or quantized with ``bits``) and
    returns the keys as ``keys_from_values(values)``, a :class:`~gemma4_mlx.ops.DerivedKeys` that
    makes them when attention reads them. Grows in steps of 256 tokens, as mlx-lm's ``KVCache``.

    Written here because mlx-lm's caches store the keys they are given."""

    step = 256

    def __init__(self, keys_from_values: Callable, bits: int | None = None, group_size: int = 64):
        self.keys_from_values = keys_from_values
        self.bits, self.group_size = bits, group_size
        self.buffers: list | None = None  # [values], or [packed, scales, biases]
        self.offset = 0

    def update_and_fetch(self, keys, values):
        """Store ``values`` (``keys`` are a function of them, not stored); return all keys and values."""
        parts = mx.quantize(values, group_size=self.group_size, bits=self.bits) if self.bits else (values,)
        prev, n = self.offset, values.shape[2]
        if self.buffers is None or prev + n > self.buffers[0].shape[2]:
            grow = -(-n // self.step) * self.step
            new = [mx.zeros((*p.shape[:2], grow, p.shape[3]), p.dtype) for p in parts]
            old = self.buffers
            self.buffers = new if old is None else [mx.concatenate([b[..., :prev, :], z], axis=2) for b, z in zip(old, new)]
        self.offset += n
        for buffer, part in zip(self.buffers, parts):
            buffer[..., prev : self.offset, :] = part
        return self.keys_and_values()

    @property
    def values(self):
        """The stored values (an array, or a ``(packed, scales, biases)`` triple), or None."""
        if self.buffers is None:
            return None
        parts = [b if b.shape[2] == self.offset else b[..., : self.offset, :] for b in self.buffers]
        return tuple(parts) if self.bits else parts[0]

    @property
    def keys(self):
        return None if self.buffers is None else self.keys_from_values(self.values)

    def keys_and_values(self):
        values = self.values
        return self.keys_from_values(values), values

    @property
    def state(self):
        return self.buffers, self.offset


    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def empty(self):
        return self.buffers is None

    @property
    def nbytes(self):
        return 0 if self.buffers is None else sum(b.nbytes for b in self.buffers)


class PassedLayerCache(_TrimmableCache):
    """The cache of a layer another process runs (pipeline parallelism): it holds nothing and only
    counts the tokens that went by, so that every process's cache list has the same offsets and
    trims alike (generation reads and rewinds ``cache[0]`` whichever process it runs in).

    One more of them ends the cache list of every process but the last: its ``state`` is what the
    process last sent on, so that evaluating the caches (as a prefill does, without the logits)
    also sends the residual stream to the process waiting for it. With a drafter, the last of them
    also holds the all_gather of the drafter's sources (:meth:`PipelineStage.share_sources`): every
    process must take part in it, even one that keeps no copy fed by it."""

    def __init__(self):
        self.offset = 0
        self.sent = None
        self.gathered = None

    def update_and_fetch(self, keys, values):
        raise RuntimeError("this layer runs in another process of the pipeline; its cache holds nothing here")

    def advance(self, n: int) -> None:
        self.offset += n

    @property
    def keys(self):
        return None

    @property
    def values(self):
        return None

    @property
    def state(self):
        return [a for a in (self.sent, self.gathered) if a is not None]


    def empty(self):
        return True

    @property
    def nbytes(self):
        return 0


QUANTIZED_CACHES = (QuantizedKVCache, QuantizedRotatingKVCache)
RING_CACHES = (RotatingKVCache, QuantizedRotatingKVCache)  # cannot be trimmed once wrapped


def check_kv_quantization(cfg: TextConfig, kv_bits: int | None, kv_group_size: int) -> None:
    """Raise :class:`~gemma4_mlx.errors.OptionError` for a KV quantization MLX cannot do here."""
    if kv_bits is None:
        return
    if kv_bits not in KV_BITS:
        raise OptionError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))} (or None for an unquantized cache), not {kv_bits!r}")
    if kv_group_size not in KV_GROUP_SIZES:
        raise OptionError(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, not {kv_group_size!r}")
    dims = sorted({s.head_dim for s in cfg.layers})
    if any(d % kv_group_size for d in dims):
        raise OptionError(f"kv_group_size {kv_group_size} does not divide this model's head sizes ({', '.join(map(str, dims))})")


def make_cache(
    cfg: TextConfig, sliding_slack: int = 0, kv_bits: int | None = None, kv_group_size: int = 64,
    keys_from_values: dict[int, Callable] | None = None,
) -> list:  # fmt: skip
    """One cache per layer that owns K/V (KV-shared layers come last and get none).

    ``sliding_slack`` makes the sliding layers' ring buffers that many tokens longer than the window
    (mlx-lm's masks still limit attention to the window): speculative decoding uses one, so that a
    drafter can read the window plus the token before it, as transformers' drafters do.
    ``kv_bits`` (4 or 8, typically) stores keys and values quantized, ``kv_group_size`` values
    sharing a scale and a bias. ``keys_from_values`` maps the index of a K=V layer to the function
    that makes its keys from its values (``Attention.keys_from_values``): those layers then store
    their values alone (:class:`ValueOnlyKVCache`); ``Gemma4Model.make_cache`` passes them."""
    check_kv_quantization(cfg, kv_bits, kv_group_size)
    caches = []
    for spec in cfg.layers:
        if spec.is_kv_shared:
            continue
        window = cfg.sliding_window + sliding_slack
        if keys_from_values and spec.index in keys_from_values:
            caches.append(ValueOnlyKVCache(keys_from_values[spec.index], kv_bits, kv_group_size))
        elif kv_bits is None:
            caches.append(RotatingKVCache(max_size=window) if spec.is_sliding else KVCache())
        elif spec.is_sliding:
            caches.append(QuantizedRotatingKVCache(window, kv_group_size, kv_bits))
        else:
            caches.append(QuantizedKVCache(kv_group_size, kv_bits))
    return caches


def kv_quantization(cache: list) -> tuple[int | None, int]:
    """``(bits, group_size)`` of a cache's quantized layers (``(None, 64)`` when unquantized)."""
    for c in cache:
        if getattr(c, "bits", None) is not None:
            return c.bits, c.group_size
    return None, 64


def copy_cache(c):
    """A copy of one layer's cache that later updates of ``c`` leave alone (its buffers copied)."""
    saved = copy.copy(c)
    if isinstance(c, QuantizedRotatingKVCache):
        saved.rings = [copy_cache(r) for r in c.rings]
        return saved
    if isinstance(c, ValueOnlyKVCache):
        saved.buffers = None if c.buffers is None else [mx.array(b) for b in c.buffers]
        return saved
    if c.keys is not None:
        saved.keys, saved.values = tree_map(mx.array, (c.keys, c.values))
    return saved


def last_tokens(x, n: int):
    """The last ``n`` tokens (axis 2) of keys or values, arrays or quantized triples."""
    return tree_map(lambda a: a[..., -n:, :], x)


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
        if isinstance(c, QuantizedRotatingKVCache):
            for ring in c.rings:
                _cut_ring(ring, n)
        elif isinstance(c, RotatingKVCache):
            _cut_ring(c, n)
        else:
            c.trim(n)


def _cut_ring(c: RotatingKVCache, n: int) -> None:
    if c.keys is None or c._idx != c.keys.shape[2] or c._idx <= n:
        raise RuntimeError("a sliding-window cache can only be trimmed right after a longer multi-token update")
    c._idx -= n
    c.keys, c.values = c.keys[..., : c._idx, :], c.values[..., : c._idx, :]
    c.offset -= n


def in_temporal_order(c) -> tuple:
    """A layer cache's keys and values, oldest first: views of the buffers (a ring buffer that has
    wrapped in place, after single-token steps, is reordered: a copy)."""
    if isinstance(c, QuantizedRotatingKVCache):
        return c.temporal_order()
    if isinstance(c, RotatingKVCache):
        return c._temporal_order(c.keys), c._temporal_order(c.values)
    return c.keys_and_values()
