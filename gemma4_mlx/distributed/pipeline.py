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
  only counts tokens, so that every process's cache has the same offsets and rewinds alike;
* with a drafter (speculative decoding), every process drafts by itself, from mirrors of the target
  layers the drafter reads (:meth:`PipelineStage.use_drafter_sources`): their new K/V reach the
  processes the pipeline does not bring them to in one ``all_gather`` per forward pass, so all draft
  the same tokens and no drafted token travels.

What crosses each boundary is packed into one flat array per hop (one send, one receive), so the
two sides cannot disagree on the order of several transfers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten

from ..config import TextConfig
from ..errors import OptionError
from .traffic import Traffic

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
    drafter_sources: list[int] = field(default_factory=list)  # target layers a drafter reads (use_drafter_sources)
    traffic: Traffic = field(default_factory=Traffic)  # what this process sends and receives (the statistics)
    bounds: list[tuple[int, int]] = field(init=False)
    shared_sources: list[int] = field(default_factory=list, init=False)  # of those, the ones gathered (share_sources)
    _key_norms: dict = field(default_factory=dict, init=False, repr=False)  # K=V sources' k_norm weights, as gathered
    _ropes: dict = field(default_factory=dict, init=False, repr=False)

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
        """Source layers another rank runs whose cache this rank keeps a copy of (its KV-shared layers
        or a drafter read it)."""
        readers = [s for s in self.crossing(self.start) if self.owns_consumer(s)]
        return sorted(set(readers) | {s for s in self.drafter_sources if not self.owns(s)})

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

    def owner(self, layer: int) -> int:
        return next(r for r, (a, b) in enumerate(self.bounds) if a <= layer < b)

    # --- a drafter's sources
    def use_drafter_sources(self, layers) -> None:
        """Keep a cache of each of ``layers`` (the target layers a drafter reads) on every process, so
        that every process drafts the same tokens by itself. Call before making caches: one made
        before keeps no copy of them here (speculative decoding refuses it)."""
        self.drafter_sources = sorted(set(self.drafter_sources) | set(layers))
        # Gathered to all: those some process neither runs nor gets along the pipeline (for its KV-shared layers).
        along = [[s for s in self.drafter_sources if a <= s < b or s in self.crossing(a)] for a, b in self.bounds]
        self.shared_sources = [s for s in self.drafter_sources if not all(s in got for got in along)]

    def _shared_shapes(self, layer: int, batch: int, length: int) -> list[tuple[int, ...]]:
        # A K=V layer's keys are a function of its values: its values and k_norm weight travel instead.
        spec = self.config.layers[layer]
        kv = (batch, spec.num_kv_heads, length, spec.head_dim)
        return [kv, (spec.head_dim,)] if spec.k_eq_v else [kv, kv]

    def share_sources(self, h: mx.array, after: mx.array, kv: dict, received: dict, cache: list | None, layers: list) -> mx.array:
        """The new K/V of :attr:`shared_sources` from their owners to every process (one ``all_gather``
        of equal parts, the others' zeros), into this process's copies. ``after`` is what this
        process's part must follow (its send, else its receive: the ring pairs transfers in the order
        they run). Returns ``h`` after the gather, so that :meth:`from_last` follows it everywhere."""
        from ..models.cache import PassedLayerCache

        B, L = h.shape[:2]
        parts = []
        for s in self.shared_sources:
            if self.owns(s):
                k, v = kv[s]
                parts += [v, layers[s].self_attn.k_norm.weight] if self.config.layers[s].k_eq_v else [k, v]
            else:
                parts += [mx.zeros(shape, self.dtype) for shape in self._shared_shapes(s, B, L)]
        flat = mx.depends(mx.concatenate([p.astype(self.dtype).reshape(-1) for p in parts]), after)
        gathered = mx.distributed.all_gather(flat, group=self.group)
        self.traffic.add(gathered.nbytes)
        at, fetched = 0, []
        for s in self.shared_sources:
            pieces = []
            for shape in self._shared_shapes(s, B, L):
                start = self.owner(s) * flat.size + at
                pieces.append(gathered[start : start + math.prod(shape)].reshape(shape))
                at += math.prod(shape)
            if self.config.layers[s].k_eq_v:
                self._key_norms[s] = pieces[1]  # the owner's too: every process derives keys from the same bits
                pieces = [pieces[0], pieces[0]]  # a copy's keys are never read (drafter_keys makes them)
            if cache is not None and not self.owns(s) and s not in received and not isinstance(cache[s], PassedLayerCache):
                fetched += [a for _, a in tree_flatten(cache[s].update_and_fetch(*pieces))]
        # A prefill evaluates only the caches: the gather must be part of every process's.
        carrier = next((c for c in reversed(cache or ()) if isinstance(c, PassedLayerCache)), None)
        if carrier is not None:
            carrier.gathered = gathered
        elif cache is not None and not fetched:
            raise RuntimeError("this process's cache has no place for the drafter's sources' transfer")
        return mx.depends(h, [gathered, *fetched])

    def drafter_keys(self, layer: int):
        """For a K=V source, the function making its keys from its cached values as its owner does
        (the same bits on every process); None for other layers."""
        if layer not in self._key_norms:
            return None
        from ..models.text import make_rope
        from ..ops import DerivedKeys

        spec = self.config.layers[layer]
        if layer not in self._ropes:
            self._ropes[layer] = make_rope(spec.head_dim, self.config.rope_for(spec.layer_type))
        weight, rope = self._key_norms[layer], self._ropes[layer]
        return lambda values: DerivedKeys(values, weight, rope, spec.head_dim)

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
        self.traffic.add(flat.nbytes)
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
        self.traffic.add(flat.nbytes)
        if cache is not None:
            cache[-1].sent = sent
        return mx.depends(h, sent)

    def from_last(self, h: mx.array) -> mx.array:
        """The last rank's ``h`` on every rank (an ``all_gather``; the others' parts are dropped)."""
        gathered = mx.distributed.all_gather(h.astype(self.dtype), group=self.group)
        self.traffic.add(gathered.nbytes)
        b = h.shape[0]
        return gathered[(self.size - 1) * b : self.size * b].astype(h.dtype)

    def describe(self) -> str:
        return ", ".join(f"rank {r}: layers {a}-{b - 1}" for r, (a, b) in enumerate(self.bounds))
