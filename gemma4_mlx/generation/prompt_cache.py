"""Reusing a conversation's KV cache across turns, so a new turn only prefills what is new.

The cache remembers the token ids it holds. A new prompt is compared with them: where the cache is
a prefix of the new prompt, prefill continues from its end. Where the two diverge (a regenerated
reply, an edited message, reasoning that the chat template strips from earlier turns), the cache
must be rewound. Full-attention caches (``KVCache``) can be trimmed to any length, but the
sliding-window ones are ring buffers that overwrite their oldest tokens, so once wrapped they cannot
be trimmed. We therefore keep *snapshots*: copies of the sliding-window caches (window x KV heads x
head dim each, small next to the weights) taken at message boundaries, and rewind to the latest
snapshot at or before the divergence point.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
from mlx_lm.utils import common_prefix_len

from ..models.cache import RING_CACHES, copy_cache
from .decode import prefill


class PromptCache:
    """A model's KV cache, the token ids it holds, and snapshots to rewind it."""

    def __init__(self, model, max_snapshots: int = 2, sliding_slack: int = 0, kv_bits: int | None = None, kv_group_size: int = 64):
        self.model = model
        self.max_snapshots = max_snapshots
        self.sliding_slack = sliding_slack  # see Gemma4Model.make_cache
        self.kv_quantization = (kv_bits, kv_group_size)
        self.reset()

    def reset(self, kv_bits: int | None = None, kv_group_size: int | None = None) -> None:
        """Start from an empty cache (quantized as before, or as ``kv_bits``/``kv_group_size`` say)."""
        if kv_group_size is not None:
            self.kv_quantization = (kv_bits, kv_group_size)
        bits, group = self.kv_quantization
        self.cache = self.model.make_cache(sliding_slack=self.sliding_slack, kv_bits=bits, kv_group_size=group)
        self.ids: list[int] = []
        self.snapshots: dict[int, list] = {}

    @property
    def offset(self) -> int:
        return self.cache[0].offset if self.cache else len(self.ids)

    def reusable(self, ids: list[int]) -> int:
        """How many of the prompt ``ids``'s tokens :meth:`reuse` would keep (nothing changes)."""
        usable = min(common_prefix_len(self.ids, ids), len(ids) - 1)
        if usable == len(self.ids):
            return usable
        return max((p for p in self.snapshots if p <= usable), default=0)

    def reuse(self, ids: list[int]) -> int:
        """Prepare the cache for the prompt ``ids``; returns how many of its tokens it already holds.

        At least the last token is always left to run, since its logits give the first new token.
        """
        usable = min(common_prefix_len(self.ids, ids), len(ids) - 1)
        if usable == len(self.ids):
            return usable
        points = [p for p in self.snapshots if p <= usable]
        if not points:
            self.reset()
            return 0
        self._restore(max(points))
        return len(self.ids)

    def extend(self, model, ids: list[int], embeds, vision_blocks, snapshot_points: set[int], step_size: int, stop=None) -> bool:
        """Run ``ids[self.offset:]`` into the cache (``ids`` continue what it holds; ``embeds`` and
        ``vision_blocks`` cover ``ids[self.offset:]`` and ``ids``), snapshotting where it reaches a
        position in ``snapshot_points``. ``stop()`` is asked between prefill chunks: returns False
        when it stopped there (the cache then holds the whole chunks run so far)."""
        start = position = self.offset
        for end in sorted(p for p in snapshot_points | {len(ids)} if p > position):
            if position > start and stop is not None and stop():
                return False
            part_embeds = None if embeds is None else embeds[position - start : end - start]
            blocks = None if vision_blocks is None else vision_blocks[position:end]
            done = prefill(model, ids[position:end], self.cache, step_size, None, part_embeds, blocks, stop)
            self.advance(ids)
            if position + done < end:
                return False
            position = end
            if end in snapshot_points:
                self.snapshot()
        return True

    def advance(self, ids: list[int]) -> None:
        """The cache has run on through ``ids`` (as far as its offset): remember which tokens it holds."""
        self.ids = list(ids[: self.offset])

    def snapshot(self) -> None:
        """Remember the cache as it is now (at ``len(self.ids)`` tokens)."""
        position = self.offset
        # Full layers are trimmed back on restore; sliding ones are copied, not referenced (caches
        # update their buffers in place).
        saved = [copy_cache(c) if isinstance(c, RING_CACHES) else None for c in self.cache]
        mx.eval([s.state for s in saved if s is not None and not s.empty()])
        self.snapshots[position] = saved
        while len(self.snapshots) > self.max_snapshots:
            del self.snapshots[min(self.snapshots)]

    def _restore(self, position: int) -> None:
        saved = self.snapshots[position]
        for i, (c, s) in enumerate(zip(self.cache, saved)):
            if s is None:
                c.trim(c.offset - position)
            else:
                self.cache[i] = copy_cache(s)
        self.ids = self.ids[:position]
        self.snapshots = {p: v for p, v in self.snapshots.items() if p <= position}

    def nbytes(self) -> int:
        """Bytes held by the cache and its snapshots."""
        total = sum(c.nbytes for c in self.cache if not c.empty())
        for saved in self.snapshots.values():
            total += sum(s.nbytes for s in saved if s is not None and not s.empty())
        return total


class PromptCachePool:
    """The caches of several recent conversations (a server's clients, the app's tabs).

    A request continues the cache of its own conversation: one it shares at least all but that
    cache's last two turns with (a new turn, or the last message regenerated or edited), the one
    keeping most of the prompt. A prompt that diverges earlier (another conversation, maybe with
    the same system prompt) gets an empty cache, a new one while there is room (``size`` caches),
    or else the least recently used: never cutting another conversation back to a shared system
    prompt. Caches beyond ``memory_limit`` bytes in all are dropped, least recently used first
    (the one in use always stays). ``turn_start_id`` marks turns (``<|turn>``)."""

    def __init__(
        self, model, size: int = 1, max_snapshots: int = 2, sliding_slack: int = 0, memory_limit: int | None = None,
        turn_start_id: int | None = None,
    ):  # fmt: skip
        if size < 1:
            raise ValueError(f"a prompt cache pool holds at least one cache, not {size}")
        self.model, self.size, self.memory_limit, self.turn_start_id = model, size, memory_limit, turn_start_id
        self._new = lambda: PromptCache(model, max_snapshots, sliding_slack)
        self.caches: list[PromptCache] = [self._new()]  # least recently used first
        # How many caches to drop, from the count this process wants (a sharded model's processes
        # hold different parts of each cache but must keep the same ones: see ChatEngine).
        self.agree: Callable[[int], int] = lambda count: count

    @property
    def latest(self) -> PromptCache:
        """The cache used last."""
        return self.caches[-1]

    def _same_conversation(self, cache: PromptCache, ids: list[int]) -> bool:
        if self.size == 1:
            return True  # nowhere else to go
        starts = [i for i, t in enumerate(cache.ids) if t == self.turn_start_id]
        return common_prefix_len(cache.ids, ids) >= (starts[-2] if len(starts) >= 2 else 0)

    def take(self, ids: list[int]) -> PromptCache:
        """The cache for the prompt ``ids`` (made the most recently used)."""
        own = [((c.reusable(ids), common_prefix_len(c.ids, ids)), c) for c in self.caches if c.ids and self._same_conversation(c, ids)]
        if own:
            best = max(own, key=lambda pair: pair[0])[1]
        else:
            best = next((c for c in self.caches if not c.ids), None)
            if best is None and len(self.caches) < self.size:
                best = self._new()
                self.caches.append(best)
            best = best or self.caches[0]
        self.caches.remove(best)
        self.caches.append(best)
        return best

    def fit(self) -> None:
        """Drop the least recently used caches while all of them hold more than ``memory_limit``."""
        drop, total = 0, sum(c.nbytes() for c in self.caches) if self.memory_limit is not None else 0
        while self.memory_limit is not None and len(self.caches) - drop > 1 and total > self.memory_limit:
            total -= self.caches[drop].nbytes()
            drop += 1
        del self.caches[: min(self.agree(drop), len(self.caches) - 1)]

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.caches)
