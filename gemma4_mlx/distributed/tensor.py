"""Tensor parallelism: every decoder layer split across the processes of an ``mx.distributed``
group, as mlx-lm shards the models it supports.

Per layer:

* attention: the query heads, and the K/V heads where their count divides (else the one K/V head
  a process's query heads read, see :func:`kv_heads_kept`), are split among the processes with
  MLX's ``shard_inplace`` (``all-to-sharded``: no communication); the output projection is
  MLX's ``shard_linear(..., "sharded-to-all")``, which sums the parts (one ``all_sum``);
* the dense MLP and each MoE expert: their hidden units split (gate and up rows, down columns) and
  the output summed (one ``all_sum`` each). Split by hand (:func:`split_glu`), because MLX's helpers
  split only into equal parts and a quantized down projection can only be cut at its quantization
  groups: the 26B's 704-wide experts (11 groups of 64) and 2112-wide MLP (33 groups) do not halve.

Embeddings, norms, the router, the per-layer inputs and the media encoders are not split (every
process computes them). Two ``all_sum`` per layer (three with MoE) each forward pass: worth it over a
fast link (JACCL's RDMA over Thunderbolt 5); over TCP, pipeline parallelism moves far less.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.nn.layers.distributed import shard_inplace, shard_linear

from ..errors import OptionError


def kv_heads_kept(q_heads: int, kv_heads: int, size: int, rank: int) -> tuple[int, int] | None:
    """``(first, count)``: the K/V heads process ``rank`` of ``size`` holds, so that its share of the
    query heads reads them in the same GQA groups: its share of them when they divide; all of a
    single one; the one its query heads all read when each group spans several processes (E4B's 2
    heads on 4); None when the heads cannot be split so."""
    if q_heads % size:
        return None
    if kv_heads % size == 0:
        return rank * (kv_heads // size), kv_heads // size
    if kv_heads == 1:
        return 0, 1
    mine, group = q_heads // size, q_heads // kv_heads
    if q_heads % kv_heads == 0 and group % mine == 0:
        return rank * mine // group, 1
    return None


def kv_heads_held(q_heads: int, kv_heads: int, size: int) -> int:
    """How many K/V heads each process holds (the same on every one; see :func:`kv_heads_kept`)."""
    return kv_heads_kept(q_heads, kv_heads, size, 0)[1]


def check_divisible(text, size: int) -> None:
    """Raise :class:`OptionError` when the model's attention heads do not split ``size`` ways."""
    problems = []
    if text.num_attention_heads % size:
        problems.append(f"{text.num_attention_heads} attention heads")
    for spec in text.layers:
        if kv_heads_kept(text.num_attention_heads, spec.num_kv_heads, size, 0) is None and text.num_attention_heads % size == 0:
            problems.append(f"{spec.num_kv_heads} K/V heads")
    if problems:
        raise OptionError(
            f"tensor parallelism cannot split {' or '.join(sorted(set(problems)))} {size} ways: "
            f"use a number of processes dividing them, or --parallel pipeline"
        )


def split_points(total: int, size: int, align: int = 1) -> list[int]:
    """``size + 1`` bounds cutting ``total`` units into ``size`` runs as even as possible, each a
    whole number of ``align``-unit groups (the first runs get one group more)."""
    groups, rest = divmod(total, align)
    if rest or groups < size:
        raise OptionError(f"cannot split {total} hidden units {size} ways in groups of {align}")
    base, extra = divmod(groups, size)
    bounds = [0]
    for r in range(size):
        bounds.append(bounds[-1] + (base + (r < extra)) * align)
    return bounds


def _slice(array: mx.array, axis: int, start: int, stop: int) -> mx.array:
    index = [slice(None)] * array.ndim
    index[axis] = slice(start, stop)
    return mx.contiguous(array[tuple(index)])  # a copy: the whole array can be freed


def _rows(linear, start: int, stop: int) -> None:
    """Keep output rows ``[start, stop)`` of a (quantized, per-expert) linear, in place."""
    for key in ("weight", "scales", "biases"):
        if key in linear:
            linear[key] = _slice(linear[key], -2, start, stop)
    if "bias" in linear:
        linear["bias"] = _slice(linear["bias"], -1, start, stop)


def _columns(linear, start: int, stop: int) -> None:
    """Keep input columns ``[start, stop)`` of a (quantized, per-expert) linear, in place; a
    quantized one's bounds are multiples of its group size."""
    if "scales" in linear:
        gs = linear.group_size
        inputs = linear["scales"].shape[-1] * gs
        packed = linear["weight"].shape[-1] * start // inputs, linear["weight"].shape[-1] * stop // inputs
        linear["weight"] = _slice(linear["weight"], -1, *packed)
        for key in ("scales", "biases"):
            if key in linear:
                linear[key] = _slice(linear[key], -1, start // gs, stop // gs)
    else:
        linear["weight"] = _slice(linear["weight"], -1, start, stop)


def split_glu(gate, up, down, group: mx.distributed.Group) -> None:
    """Keep this process's share of a GLU's hidden units (an MLP's or every expert's), in place:
    gate and up rows, down columns, cut at down's quantization groups. The caller sums the outputs."""
    hidden = down["scales"].shape[-1] * down.group_size if "scales" in down else down["weight"].shape[-1]
    bounds = split_points(hidden, group.size(), down.group_size if "scales" in down else 1)
    start, stop = bounds[group.rank()], bounds[group.rank() + 1]
    _rows(gate, start, stop)
    _rows(up, start, stop)
    _columns(down, start, stop)


def shard_layer(layer, group: mx.distributed.Group) -> None:
    """Split one decoder layer among ``group``'s processes, in place: q heads (and K/V heads where
    their count divides: a KV-shared or drafter layer then reads this process's share of them, the
    same GQA groups), the output projection summed, the MLP's and experts' hidden units."""
    size = group.size()
    attn, spec = layer.self_attn, layer.spec
    first, count = kv_heads_kept(attn.n_heads, spec.num_kv_heads, size, group.rank())
    shard_inplace(attn.q_proj, "all-to-sharded", group=group)
    attn.n_heads //= size
    projections = [] if spec.is_kv_shared else [attn.k_proj] + ([attn.v_proj] if "v_proj" in attn else [])  # K=V: no v_proj
    if count * size == spec.num_kv_heads:  # an equal share each
        for proj in projections:
            shard_inplace(proj, "all-to-sharded", group=group)
    elif count < spec.num_kv_heads:  # the one head this process's query heads read (by hand: not an equal split)
        for proj in projections:
            _rows(proj, first * attn.head_dim, (first + count) * attn.head_dim)
    attn.n_kv_heads = count  # else every process computes the single K/V head
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    mlp = layer.mlp
    split_glu(mlp.gate_proj, mlp.up_proj, mlp.down_proj, group)
    mlp.group = group
    if layer.has_moe:
        glu = layer.experts.switch_glu
        split_glu(glu.gate_proj, glu.up_proj, glu.down_proj, group)
        layer.experts.group = group


def shard_layers(model, group: mx.distributed.Group) -> None:
    """Split every decoder layer of a loaded (unmerged) model among ``group``'s processes, in place."""
    check_divisible(model.text_config, group.size())
    for layer in model.layers:
        shard_layer(layer, group)
    # Each forward pass sums every layer's attention output and MLP (and experts): counted in the traffic.
    model.language_model.sums_per_pass = sum(2 + layer.has_moe for layer in model.layers)
    model.language_model.tensor_group = group  # a drafter meeting this model is split alike (shard_drafter)


def shard_drafter(drafter, group: mx.distributed.Group, target_query_heads: int | None = None) -> None:
    """Split a drafter's layers as the target's (:func:`shard_layer`), so that its query heads read
    the K/V heads this process holds; its embeddings, LM head and projections stay whole."""
    size, tc = group.size(), drafter.config.text_config
    target_heads = target_query_heads if target_query_heads is not None else tc.num_attention_heads
    problems = [f"{tc.num_attention_heads} attention heads"] if tc.num_attention_heads % size else []
    for s in drafter.config.layer_specs() if not problems else ():
        kept = [kv_heads_kept(tc.num_attention_heads, s.num_kv_heads, size, r) for r in range(size)]
        if None in kept or kept != [kv_heads_kept(target_heads, s.num_kv_heads, size, r) for r in range(size)]:
            problems.append(f"{s.num_kv_heads} K/V heads (for its {tc.num_attention_heads} query heads)")
    if problems:
        raise OptionError(
            f"tensor parallelism cannot split the draft model's {' or '.join(sorted(set(problems)))} {size} ways "
            "as the target's: use another number of processes, or --parallel pipeline"
        )
    for layer in drafter.layers:
        shard_layer(layer, group)
    drafter.tensor_group = group
    drafter.materialize()
