"""Pipeline parallelism: the decoder's layers split across the processes of an ``mx.distributed``
group, in order (rank 0 the first layers, the last rank the last ones).

Every process runs the same program (the same prompt, the same generation loop, the same sampled
tokens): at each forward, rank 0 embeds the tokens (and runs the vision/audio encoders), runs its
layers and sends the residual stream on; each next rank receives it, runs its layers and sends on;
the last rank's output goes back to every rank (``all_gather``), which then applies the final norm
and the LM head, so that all sample the same token. This is mlx-lm's scheme (``PipelineMixin``),
with what Gemma 4 adds:

* E2B/E4B per-layer inputs are made on rank 0 (it holds the table) and the later layers' slices
  travel with the residual stream;
* a KV-shared layer on a later rank than its source layer gets the source's new keys and values
  with the stream, and keeps its own copy of the source's cache (the *mirror*), updated the same way;
* the layers a process does not run get a :class:`~gemma4_mlx.models.cache.PassedLayerCache`, which
  only counts tokens, so that every process's cache has the same offsets and rewinds alike.

What crosses each boundary is packed into one flat array per hop (one send, one receive), so the
two sides cannot disagree on the order of several transfers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import mlx.core as mx

from ..config import TextConfig
from ..errors import OptionError

# Weights only the first rank reads: the media encoders and the per-layer embeddings it makes.
FIRST_RANK_ONLY = (
    "vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.", "vision_embedder.",
    "language_model.embed_tokens_per_layer.", "language_model.per_layer_model_projection.",
    "language_model.per_layer_projection_norm.",
)  # fmt: skip


def split_layers(num_layers: int, size: int, memory: list[float] | None = None) -> list[int]:
    """Layers per rank: in proportion to each machine's ``memory`` (any unit), else as even as
    possible (the first ranks get one more). Each rank gets at least one layer."""
    if size < 1 or num_layers < size:
        raise OptionError(f"cannot split {num_layers} layers across {size} processes: each needs at least one layer")
    if memory is None:
        base, extra = divmod(num_layers, size)
        return [base + (r < extra) for r in range(size)]
    if len(memory) != size or any(m <= 0 for m in memory):
        raise OptionError(f"memory needs one positive number per process ({size}), got {memory}")
    total = sum(memory)
    # Largest remainders, after giving each rank one layer.
    spare = num_layers - size
    shares = [spare * m / total for m in memory]
    counts = [1 + int(s) for s in shares]
    for r in sorted(range(size), key=lambda r: shares[r] - int(shares[r]), reverse=True)[: num_layers - sum(counts)]:
        counts[r] += 1
    return counts


def parse_split(text: str, size: int, num_layers: int) -> list[int]:
    """``--split 20,15``: layers per rank, given by hand (they must add up to the model's layers)."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise OptionError(f"--split takes layer counts separated by commas, e.g. 20,15; got {text!r}") from None
    if len(counts) != size or any(c < 1 for c in counts) or sum(counts) != num_layers:
        raise OptionError(f"--split {text} must give {size} positive layer counts adding up to {num_layers}")
    return counts


class _Planned:
    """A stand-in for an ``mx.distributed.Group`` of ``size`` processes, seen from ``rank``."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@dataclass
class PipelineStage:
    """This process's part of the pipeline: layers ``[start, end)`` of ``counts`` per rank."""

    group: mx.distributed.Group
    config: TextConfig
    counts: list[int]
    dtype: mx.Dtype = mx.float32  # the activations' type on the wire (set from the weights when loaded)
    bounds: list[tuple[int, int]] = field(init=False)

    def __post_init__(self):
        if len(self.counts) != self.size or sum(self.counts) != self.config.num_hidden_layers:
            raise OptionError(f"layer split {self.counts} does not fit {self.size} processes and {self.config.num_hidden_layers} layers")
        ends = [sum(self.counts[: r + 1]) for r in range(self.size)]
        self.bounds = [(e - c, e) for e, c in zip(ends, self.counts)]

    @classmethod
    def planned(cls, config: TextConfig, counts: list[int], rank: int) -> "PipelineStage":
        """Process ``rank``'s part of a split, without a group (to plan memory, not to run)."""
        return cls(_Planned(rank, len(counts)), config, counts)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def start(self) -> int:
        return self.bounds[self.rank][0]

    @property
    def end(self) -> int:
        return self.bounds[self.rank][1]

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def owns(self, layer: int) -> bool:
        return self.start <= layer < self.end

    # --- which K/V cross which boundary
    def _consumers(self, source: int) -> list[int]:
        return [s.index for s in self.config.layers if s.is_kv_shared and s.kv_source == source]

    def crossing(self, boundary: int) -> list[int]:
        """Source layers before ``boundary`` whose K/V a KV-shared layer at or after it reads."""
        sources = sorted({s.kv_source for s in self.config.layers if s.is_kv_shared})
        return [s for s in sources if s < boundary and any(c >= boundary for c in self._consumers(s))]

    def owns_consumer(self, source: int) -> bool:
        """Whether a KV-shared layer this rank runs reads ``source``'s K/V."""
        return any(self.owns(c) for c in self._consumers(source))

    @property
    def mirrors(self) -> list[int]:
        """Source layers another rank runs whose cache this rank keeps a copy of (its KV-shared layers read it)."""
        return [s for s in self.crossing(self.start) if self.owns_consumer(s)]

    def cached_here(self, layer: int) -> bool:
        """Whether this rank keeps a real cache for ``layer`` (it runs it, or mirrors it)."""
        return self.owns(layer) or layer in self.mirrors

    def reference_layer(self, layer_type: str) -> int | None:
        """The layer whose cache this rank's masks of ``layer_type`` are made from: its first own
        layer of that type that has a cache, else the mirrored source of that type."""
        for s in self.config.layers:
            if s.layer_type == layer_type and self.owns(s.index):
                return s.kv_source if s.is_kv_shared else s.index
        return None

    def keeps(self, name: str) -> bool:
        """Whether this rank loads the weight ``name`` (our module tree's names): its own layers', the
        media encoders' and per-layer embedding tables' on the first rank, and the embeddings and
        final norm everywhere (every rank applies the tied LM head)."""
        m = re.match(r"language_model\.layers\.(\d+)\.", name)
        if m:
            return self.owns(int(m.group(1)))
        if name.startswith(FIRST_RANK_ONLY):
            return self.is_first
        return True

    def advance_passed(self, cache: list | None, length: int) -> None:
        """Count ``length`` tokens in the caches of the layers other ranks run."""
        from ..models.cache import PassedLayerCache

        for c in cache or ():
            if isinstance(c, PassedLayerCache):
                c.advance(length)

    # --- the wire
    def _shapes(self, boundary: int, batch: int, length: int) -> list[tuple[int, ...]]:
        cfg = self.config
        shapes = [(batch, length, cfg.hidden_size)]
        if cfg.has_per_layer_inputs:
            shapes.append((batch, length, cfg.num_hidden_layers - boundary, cfg.hidden_size_per_layer_input))
        for s in self.crossing(boundary):
            spec = cfg.layers[s]
            shapes += [(batch, spec.num_kv_heads, length, spec.head_dim)] * 2
        return shapes

    def receive(self, batch: int, length: int) -> tuple[mx.array, mx.array | None, dict[int, tuple[mx.array, mx.array]]]:
        """From the previous rank: the residual stream, the per-layer inputs of layers ``start`` on
        (or None), and the new K/V of the source layers crossing into this rank."""
        shapes = self._shapes(self.start, batch, length)
        sizes = [math.prod(s) for s in shapes]
        flat = mx.distributed.recv((sum(sizes),), self.dtype, self.rank - 1, group=self.group)
        parts, at = [], 0
        for shape, n in zip(shapes, sizes):
            parts.append(flat[at : at + n].reshape(shape))
            at += n
        h, rest = parts[0], parts[1:]
        per_layer = rest.pop(0) if self.config.has_per_layer_inputs else None
        kv = {s: (rest[2 * i], rest[2 * i + 1]) for i, s in enumerate(self.crossing(self.start))}
        return h, per_layer, kv

    def send(self, h: mx.array, per_layer: mx.array | None, per_layer_base: int, kv: dict[int, tuple], cache: list | None = None) -> mx.array:
        """To the next rank: what :meth:`receive` there expects. Returns ``h``, now depending on the
        send; the cache's last entry holds the send too, so that evaluating the cache sends."""
        parts = [h]
        if per_layer is not None:
            parts.append(per_layer[:, :, self.end - per_layer_base :])
        for s in self.crossing(self.end):
            parts += list(kv[s])
        flat = mx.concatenate([p.astype(self.dtype).reshape(-1) for p in parts])
        sent = mx.distributed.send(flat, self.rank + 1, group=self.group)
        if cache is not None:
            cache[-1].sent = sent
        return mx.depends(h, sent)

    def from_last(self, h: mx.array) -> mx.array:
        """The last rank's ``h`` on every rank (an ``all_gather``; the others' parts are dropped)."""
        gathered = mx.distributed.all_gather(h.astype(self.dtype), group=self.group)
        b = h.shape[0]
        return gathered[(self.size - 1) * b : self.size * b].astype(h.dtype)

    def describe(self) -> str:
        return ", ".join(f"rank {r}: layers {a}-{b - 1}" for r, (a, b) in enumerate(self.bounds))
