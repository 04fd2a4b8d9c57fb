"""The Gemma 4 text decoder, for every variant (E2B, E4B, 26B-A4B, 31B).

Each layer is described by a :class:`~gemma4_mlx.config.LayerSpec`, so one set of modules covers
sliding/full layers with different head dims and KV heads, K=V full layers, KV-shared layers,
double-wide MLPs, per-layer embeddings (PLE) and the MoE block. Ground truth is transformers
5.23's ``modeling_gemma4.py``; the comments name where Gemma 4 differs from earlier Gemmas.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.models.switch_layers import SwitchGLU, _gather_sort, _scatter_unsort

from .. import ops
from . import merging
from .cache import PassedLayerCache
from ..ops.compiled import compiled
from ..config import FULL, SLIDING, LayerSpec, TextConfig, UnsupportedModelError


def materialize(module: nn.Module) -> None:
    """Evaluate every array a module tree holds: its parameters and the arrays modules keep outside
    them (RoPE tables and the like). A lazy array made on one thread cannot be evaluated on another,
    so models used from other threads (the chat engine) must be materialized."""
    private = [v for _, m in module.named_modules() for k, v in m.items() if k.startswith("_") and isinstance(v, mx.array)]
    mx.eval(module.parameters(), private)


@compiled(shapeless=True)
def softcap(x: mx.array, cap: float) -> mx.array:
    return mx.tanh(x / cap) * cap


def make_rope(head_dim: int, params: dict[str, Any]) -> nn.Module:
    """RoPE for one layer type, by mlx-lm's ``initialize_rope``: "default" (all dims) or
    "proportional" (rotate-half over all dims, but only the first ``partial_rotary_factor`` of the
    frequency pairs turn: dims 0-63 pair with 256-319 at head_dim 512; the rest are identity)."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise UnsupportedModelError(f"unsupported rope_type {rope_type!r}")
    return initialize_rope(head_dim, float(params.get("rope_theta", 10_000.0)), traditional=False, scaling_config=params)


class Attention(nn.Module):
    """Self-attention with q/k/v norms, scale 1.0, optional K=V and optional shared K/V."""

    def __init__(self, cfg: TextConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = spec.num_kv_heads  # both divided among processes under tensor parallelism
        self.head_dim = spec.head_dim
        self.eps = cfg.rms_norm_eps
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
        if not spec.is_kv_shared:
            self.k_proj = nn.Linear(cfg.hidden_size, spec.num_kv_heads * self.head_dim, bias=bias)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
            if not spec.k_eq_v:
                self.v_proj = nn.Linear(cfg.hidden_size, spec.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.rope = make_rope(self.head_dim, cfg.rope_for(spec.layer_type))

    def merge_projections(self) -> None:
        """q/k/v (q/k in K=V layers) as one matmul, and their norms as one unscaled RMSNorm times
        per-head weights and one RoPE over q and k together: 3 to 5 fewer kernels per layer, the
        same values (MLX's RMSNorm rounds the normalised value before scaling it, so scaling after
        it is bit-identical). KV-shared layers project only q: nothing to merge."""
        if self.spec.is_kv_shared or "qkv_proj" in self:
            return
        parts = [self.q_proj, self.k_proj] + ([] if self.spec.k_eq_v else [self.v_proj])
        if not merging.can_merge(parts):
            return
        D = self.head_dim
        q_weight = mx.broadcast_to(self.q_norm.weight, (self.n_heads, D))
        k_weight = mx.broadcast_to(self.k_norm.weight, (self.n_kv_heads, D))
        self._qk_norm_weight = mx.concatenate([q_weight, k_weight]).astype(self.q_norm.weight.dtype)
        self.qkv_proj = merging.merge(parts)
        for name in ("q_proj", "k_proj", "v_proj"):
            if name in self:
                delattr(self, name)

    def project(self, x, offset):
        """q [B, H, L, D] and this layer's new k, v (normed and rotated; None in KV-shared layers)."""
        if "qkv_proj" in self:
            return self._project_merged(x, offset)
        B, L, _ = x.shape
        q = ops.rms_norm(self.q_proj(x).reshape(B, L, -1, self.head_dim), self.q_norm.weight, self.eps)
        q = ops.rope(q.transpose(0, 2, 1, 3), offset, self.rope)
        if self.spec.is_kv_shared:
            return q, None, None
        k = self.k_proj(x).reshape(B, L, -1, self.head_dim)
        # K=V layers: V is the raw k_proj output, before k_norm and without RoPE.
        v = k if self.spec.k_eq_v else self.v_proj(x).reshape(B, L, -1, self.head_dim)
        k = ops.rope(ops.rms_norm(k, self.k_norm.weight, self.eps).transpose(0, 2, 1, 3), offset, self.rope)
        v = ops.rms_norm(v, None, self.eps).transpose(0, 2, 1, 3)
        return q, k, v

    def _project_merged(self, x, offset):
        """:meth:`project` after :meth:`merge_projections`: heads [q | k | v] from one matmul."""
        B, L, _ = x.shape
        Hq, Hkv = self.n_heads, self.n_kv_heads
        normed = ops.rms_norm(self.qkv_proj(x).reshape(B, L, -1, self.head_dim), None, self.eps)
        scaled = (normed[:, :, : Hq + Hkv] * self._qk_norm_weight).transpose(0, 2, 1, 3)
        # K=V layers: V is k_proj's output normed without a scale, which is the k heads of `normed`.
        v = (normed[:, :, Hq : Hq + Hkv] if self.spec.k_eq_v else normed[:, :, Hq + Hkv :]).transpose(0, 2, 1, 3)
        if L == 1:
            qk = ops.rope(scaled, offset, self.rope)
            return qk[:, :Hq], qk[:, Hq:], v
        # A chunk: k and v get buffers of their own. A sliding cache keeps its first chunk as given,
        # and views would keep the whole merged q/k/v buffers alive with it (3x the prefill's memory).
        return ops.rope(scaled[:, :Hq], offset, self.rope), ops.rope(scaled[:, Hq:], offset, self.rope), mx.contiguous(v)

    def keys_from_values(self, values, start: int = 0) -> ops.DerivedKeys:
        """A K=V layer's keys from its cached values (an array or a quantized triple), made when
        attention reads them: ``rope(k_norm.weight * values)``, the product and rotation
        :meth:`project` makes new keys with."""
        return ops.DerivedKeys(values, self.k_norm.weight, self.rope, self.head_dim, start)

    def output(self, out):
        """The output projection of the attention result [B, H, L, D]."""
        B, _, L, _ = out.shape
        # One token: [B, H, 1, D] already has [B, 1, H * D]'s memory order, no transpose (copy) needed.
        out = out.reshape(B, L, -1) if L == 1 else out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.group = None  # tensor parallelism: each process holds a slice of the hidden units; summed here

    def merge_projections(self) -> None:
        """gate and up as one matmul (see :mod:`.merging`)."""
        if "gate_up_proj" not in self and merging.can_merge([self.gate_proj, self.up_proj]):
            self.gate_up_proj = merging.merge([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj

    def __call__(self, x):
        if "gate_up_proj" in self:
            gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        out = self.down_proj(ops.geglu(gate, up))
        return out if self.group is None else mx.distributed.all_sum(out, group=self.group)


class Router(nn.Module):
    """Top-k router: unscaled RMSNorm -> * scale * hidden^-0.5 -> proj -> softmax over top-k."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.top_k = cfg.top_k_experts
        self.eps = cfg.rms_norm_eps
        self.root_size = cfg.hidden_size**-0.5
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = mx.ones((cfg.hidden_size,))
        self.per_expert_scale = mx.ones((cfg.num_experts,))

    def fold_scale(self) -> None:
        """Multiply ``scale * hidden^-0.5`` once, not on every step (the same rounding either way)."""
        self._norm_weight = self.scale * self.root_size

    def __call__(self, x):
        weight = self._norm_weight if "_norm_weight" in self else self.scale * self.root_size
        x = ops.rms_norm(x, weight, self.eps)
        scores = self.proj(x)
        # softmax over all experts then renormalising the top-k equals a softmax over the top-k.
        # The top k by partitioning at -k (no negated copy of the scores), as mlx-lm does.
        idx = mx.stop_gradient(mx.argpartition(scores, kth=-self.top_k, axis=-1)[..., -self.top_k :])
        weights = mx.softmax(mx.take_along_axis(scores, idx, axis=-1).astype(mx.float32), axis=-1)
        weights = weights * self.per_expert_scale[idx].astype(mx.float32)
        return idx, weights.astype(x.dtype)


class GeGLU(nn.Module):
    """SwitchGLU's activation hook, called as activation(up, gate)."""

    def __call__(self, up, gate):
        return ops.geglu(gate, up)


class Experts(nn.Module):
    """Routed experts on mlx-lm's SwitchGLU (gather_mm / gather_qmm), weighted and summed."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.switch_glu = SwitchGLU(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, activation=GeGLU())
        self.top_k = cfg.top_k_experts
        self.group = None  # tensor parallelism: each process holds a slice of every expert; summed here

    def merge_projections(self) -> None:
        """The experts' gate and up as one gather matmul (see :class:`MergedSwitchGLU`)."""
        glu = self.switch_glu
        if isinstance(glu, SwitchGLU) and merging.can_merge([glu.gate_proj, glu.up_proj]):
            self.switch_glu = MergedSwitchGLU(merging.merge([glu.gate_proj, glu.up_proj]), glu.down_proj, self.top_k)

    def __call__(self, x, idx, weights):
        out = ops.moe_experts(x, idx, weights, self.switch_glu)
        return out if self.group is None else mx.distributed.all_sum(out, group=self.group)


_ZERO = mx.array(0, dtype=mx.uint32)  # broadcast, a view (mx.zeros is a kernel of its own)


class MergedSwitchGLU(nn.Module):
    """mlx-lm's ``SwitchGLU`` (GeGLU) with the experts' gate and up in one gather matmul, called the
    same way: ``(x [B, L, H], indices [B, L, k]) -> [B, L, k, H]``. For one token it also passes the
    rows' input indices itself, as constants: without them MLX's gather matmuls make an ``arange``
    per call (three kernels per layer per step). Written here because mlx-lm's SwitchGLU calls gate
    and up separately."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, top_k: int):
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self._expert_rows = mx.arange(top_k, dtype=mx.uint32)  # the down projection's input rows, one token

    def __call__(self, x, indices):
        x = mx.expand_dims(x, (-2, -3))
        indices = mx.stop_gradient(indices)
        sort = indices.size >= 64  # many tokens: rows sorted by expert, as SwitchGLU does
        if sort:
            x, idx, inverse = _gather_sort(x, indices)
        else:
            idx, inverse = indices, None
        rows_in = rows_mid = None  # MLX's default: each row its own input
        if indices.size == indices.shape[-1]:  # one token: every expert reads it (a broadcast zero)
            rows_in = mx.broadcast_to(_ZERO, (*indices.shape[:-1], 1))
            rows_mid = self._expert_rows.reshape(indices.shape)
        gate, up = mx.split(_switch_matmul(self.gate_up_proj, x, rows_in, idx, sort), 2, axis=-1)
        x = _switch_matmul(self.down_proj, ops.geglu(gate, up), rows_mid, idx, sort)
        if inverse is not None:
            x = _scatter_unsort(x, inverse, indices.shape)
        return x.squeeze(-2)


def _switch_matmul(proj: nn.Module, x, rows, experts, sorted_rows: bool):
    """mlx-lm's (Quantized)SwitchLinear call, with the rows' input indices ``rows`` given."""
    if "scales" in proj:
        out = mx.gather_qmm(
            x, proj["weight"], proj["scales"], proj.get("biases"), lhs_indices=rows, rhs_indices=experts,
            transpose=True, group_size=proj.group_size, bits=proj.bits, mode=proj.mode,
            global_scale=getattr(proj, "global_scale", None), sorted_indices=sorted_rows,
        )  # fmt: skip
    else:
        out = mx.gather_mm(x, proj["weight"].swapaxes(-1, -2), lhs_indices=rows, rhs_indices=experts, sorted_indices=sorted_rows)
    if "bias" in proj:
        out = out + mx.expand_dims(proj["bias"][experts], -2)
    return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, spec)
        self.mlp = MLP(h, spec.mlp_size)
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(h, eps=eps)
        self.layer_scalar = mx.ones((1,))
        self.eps = eps
        self.has_moe = cfg.enable_moe_block
        if self.has_moe:
            self.router = Router(cfg)
            self.experts = Experts(cfg)
            self.post_feedforward_layernorm_1 = nn.RMSNorm(h, eps=eps)
            self.pre_feedforward_layernorm_2 = nn.RMSNorm(h, eps=eps)
            self.post_feedforward_layernorm_2 = nn.RMSNorm(h, eps=eps)
        self.has_ple = cfg.has_per_layer_inputs
        if self.has_ple:
            self.per_layer_input_gate = nn.Linear(h, cfg.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(cfg.hidden_size_per_layer_input, h, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(h, eps=eps)

    def merge_projections(self) -> None:
        """Projections sharing an input as one matmul each (see :mod:`.merging`); values unchanged."""
        self.self_attn.merge_projections()
        self.mlp.merge_projections()
        if self.has_moe:
            self.experts.merge_projections()
            self.router.fold_scale()

    def attention_inputs(self, x, offset):
        """The layer up to attention: q and the new k, v for the residual stream ``x``."""
        return self.self_attn.project(ops.rms_norm(x, self.input_layernorm.weight, self.eps), offset)

    def finish(self, x, attn, per_layer_input=None):
        """The layer after attention: output projection, MLP (and MoE) and PLE, with their norms."""
        eps = self.eps
        x = ops.add_rms_norm(x, self.self_attn.output(attn), self.post_attention_layernorm.weight, eps)

        h = self.mlp(ops.rms_norm(x, self.pre_feedforward_layernorm.weight, eps))
        if self.has_moe:
            # The MoE block runs beside the dense MLP; the router reads the residual stream.
            idx, weights = self.router(x)
            moe = self.experts(ops.rms_norm(x, self.pre_feedforward_layernorm_2.weight, eps), idx, weights)
            moe = ops.rms_norm(moe, self.post_feedforward_layernorm_2.weight, eps)
            h = ops.add_rms_norm(moe, h, self.post_feedforward_layernorm_1.weight, eps)
        # Every layer ends scaled by its layer_scalar, after its last residual add.
        scalar = None if self.has_ple else self.layer_scalar
        x = ops.add_rms_norm(x, h, self.post_feedforward_layernorm.weight, eps, scalar)

        if self.has_ple:
            g = ops.geglu(self.per_layer_input_gate(x), per_layer_input)
            x = ops.add_rms_norm(x, self.per_layer_projection(g), self.post_per_layer_input_norm.weight, eps, self.layer_scalar)
        return x


class TextModel(nn.Module):
    """Embeddings, decoder layers and final norm; returns hidden states (the LM head is outside)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, spec) for spec in cfg.layers]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.has_per_layer_inputs:
            n, d = cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
            self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input, n * d)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, n * d, bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self._first_of_type = {t: next(s.index for s in cfg.layers if s.layer_type == t) for t in set(cfg.layer_types)}
        # Where image blocks are bidirectional (see make_masks): Gemma 4's 26B/31B only in sliding
        # layers, inside the window; the 12B unified model in every layer, past the window too.
        self.blocks_in_every_layer = False
        # Pipeline parallelism (gemma4_mlx.distributed.pipeline): this process's part, or None.
        self.stage = None
        # Several processes (gemma4_mlx.distributed.watchdog): stops this one if a pass waits too long.
        self.watchdog = None
        self.group = None  # the mx.distributed group of those processes
        self.tensor_group = None  # tensor parallelism (gemma4_mlx.distributed.tensor): the group splitting each layer
        self.sums_per_pass = 0  # and the all_sums each forward pass makes then
        self.traffic = None  # what this process exchanges with the others (gemma4_mlx.distributed.traffic)

    def use_pipeline(self, stage) -> None:
        """Run only layers ``[stage.start, stage.end)`` (the others are dropped, their weights never
        loaded); the stage passes the residual stream between processes (see
        :mod:`gemma4_mlx.distributed.pipeline`). Call before loading weights."""
        if self.config.has_per_layer_inputs and not stage.is_first:
            for name in ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm"):
                if name in self:
                    delattr(self, name)  # rank 0 makes the per-layer inputs
        for i in range(len(self.layers)):
            if not stage.owns(i):
                self.layers[i] = None
        types = {s.layer_type for s in self.config.layers if stage.owns(s.index)}
        self._first_of_type = {t: stage.reference_layer(t) for t in types}
        self.stage = stage  # a plain attribute (not an array, list or module): no parameters
        self.__dict__.pop("_compiled_pieces", None)

    def _span(self) -> tuple[int, int]:
        """The layers this process runs."""
        stage = self.stage
        return (stage.start, stage.end) if stage is not None else (0, len(self.layers))

    def embed(self, input_ids: mx.array) -> mx.array:
        """Token embeddings times sqrt(hidden) (the scale is cast to the weight dtype, as in HF)."""
        h = self.embed_tokens(input_ids)
        return h * mx.array(self.config.hidden_size**0.5, dtype=h.dtype)

    def use_mapped_ple(self, mapped) -> None:
        """Look PLE rows up in ``mapped`` (a :class:`~gemma4_mlx.loading.ple.MappedEmbedding` over
        the checkpoint file) instead of the in-memory ``embed_tokens_per_layer``, which is removed.

        The table is kept outside the module tree, so ``parameters()``/``load_weights`` skip it."""
        if mapped is None:
            raise ValueError("use_mapped_ple needs a mapped table")
        if "embed_tokens_per_layer" in self:
            del self.embed_tokens_per_layer
        self._mapped_ple = mapped

    @property
    def mapped_ple(self):
        """The memory-mapped PLE table in use (:meth:`use_mapped_ple`), or None."""
        return getattr(self, "_mapped_ple", None)

    def per_layer_token_inputs(self, input_ids: mx.array) -> mx.array:
        """Token part of PLE: [B, L, layers, ple_dim]."""
        cfg = self.config
        # A mapped table gathers its rows on the host, so it evaluates input_ids (during decode,
        # the sampled token): inherent to reading from disk, and the only sync it adds.
        mapped = self.mapped_ple
        e = mapped(input_ids) if mapped is not None else self.embed_tokens_per_layer(input_ids)
        e = e * mx.array(cfg.hidden_size_per_layer_input**0.5, dtype=e.dtype)
        return e.reshape(*input_ids.shape, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input)

    def per_layer_inputs(self, inputs_embeds: mx.array, token_inputs: mx.array) -> mx.array:
        """Combine the context part (projected merged embeddings) with the token part of PLE."""
        cfg = self.config
        ctx = self.per_layer_model_projection(inputs_embeds) * (cfg.hidden_size**-0.5)
        ctx = ctx.reshape(*inputs_embeds.shape[:-1], cfg.num_hidden_layers, cfg.hidden_size_per_layer_input)
        ctx = ops.rms_norm(ctx, self.per_layer_projection_norm.weight, cfg.rms_norm_eps)
        return (ctx + token_inputs) * (2.0**-0.5)

    def merge_projections(self) -> None:
        """Merge each layer's projections that share an input (q/k/v, gate/up) into one matmul, for
        a loaded model (the parameter names change: do it after loading weights, not before saving)."""
        for layer in self.layers:
            if layer is not None:  # None: run by another process (pipeline)
                layer.merge_projections()
        ops.invalidate_compiled()  # the compiled pieces trace the merged modules anew

    def _pieces(self, one_token: bool):
        """The decoder cut at its attentions: ``first(h, position)`` is layer 0 up to attention
        (q, k, v), and ``joins[i](h, attn, per_layer_input, position)`` finishes layer i and runs
        layer i + 1 up to its attention, returning ``(h, (q, k, v))`` (the last join returns
        ``(h, (None, None, None))``). Compiled, each piece is one cached trace: a decode step's graph
        is built from a few dozen calls instead of thousands of Python op calls, and each piece's
        elementwise chains are fused. The cache updates and attention stay outside the pieces:
        their shapes change every step. The compiled pieces take the layers' arrays as implicit
        inputs (so weights loaded or replaced later are seen) and are remade when the ops change."""
        layers = self.layers
        start, end = self._span()

        def join(i):
            def run(h, attn, per_layer_input, position):
                h = layers[i].finish(h, attn, per_layer_input)
                return h, (layers[i + 1].attention_inputs(h, position) if i + 1 < end else (None, None, None))

            return run

        if not one_token:
            return layers[start].attention_inputs, [join(i) for i in range(start, end)]
        pieces = self.__dict__.get("_compiled_pieces")
        if pieces is None:  # made once; each remakes its trace when the ops change (ops/compiled.py)
            first = compiled(layers[start].attention_inputs, inputs=layers[start])
            pieces = (first, [compiled(join(i), inputs=layers[i : min(i + 2, end)]) for i in range(start, end)])
            object.__setattr__(self, "_compiled_pieces", pieces)  # not a module attribute: no parameters
        return pieces

    def make_masks(self, h: mx.array, cache, offset: int, vision_blocks=None) -> dict[str, Any]:
        """Masks per layer type for the chunk ``h`` [B, L, hidden] (mlx-lm's causal masks; sliding
        layers also mask keys older than the window).

        ``vision_blocks`` ([B, L] ids of image blocks, -1 for text) makes each block bidirectional:
        Gemma 4's rule (transformers' ``create_masks_for_vision_model``) in sliding layers only,
        ``(causal OR same block) AND inside the window``; with ``blocks_in_every_layer`` (the 12B,
        transformers' ``create_masks_for_generate``) in every layer, ``(causal AND inside the window)
        OR same block``. Blocks must not straddle chunks.
        """
        L = h.shape[1]
        masks = {}
        for layer_type, first in self._first_of_type.items():
            window = self.config.sliding_window if layer_type == SLIDING else None
            c = cache[first] if cache is not None else None
            if vision_blocks is not None and L > 1 and (window is not None or self.blocks_in_every_layer):
                # Keys: what the cache holds from before this chunk (a rotating cache: window - 1),
                # then the chunk. (No mlx-lm helper has the block rule: built here.)
                past = (min(window - 1, offset) if window else offset) if c is not None else 0
                q = mx.arange(offset, offset + L)[:, None]
                k = mx.arange(offset - past, offset + L)[None]
                blocks = mx.array(vision_blocks)
                kb = mx.concatenate([mx.full((blocks.shape[0], past), -1, blocks.dtype), blocks], axis=1)
                same = (blocks[:, :, None] == kb[:, None, :]) & (blocks[:, :, None] >= 0)
                seen = (q >= k) & (k > q - window) if window else q >= k
                masks[layer_type] = (seen | same if self.blocks_in_every_layer else ((q >= k) | same) & (k > q - window))[:, None]
            else:
                masks[layer_type] = create_attention_mask(h, c, window_size=window)
        return masks

    def __call__(
        self,
        input_ids: mx.array | None = None,
        cache: list | None = None,
        inputs_embeds: mx.array | None = None,
        per_layer_token_inputs: mx.array | None = None,
        vision_blocks=None,
    ) -> mx.array:
        stage = self.stage
        received: dict = {}  # pipeline: new K/V of source layers run by an earlier process
        per_layer_base = 0  # the layer index of per_layer[:, :, 0]
        if self.watchdog is not None:  # several processes: this pass may wait on the others
            self.watchdog.expect("a forward pass")
        if stage is not None and not stage.is_first:
            shape = (input_ids if input_ids is not None else inputs_embeds).shape
            h, per_layer, received = stage.receive(shape[0], shape[1])
            arrived, per_layer_base = h, stage.start
        else:
            if inputs_embeds is None:
                inputs_embeds = self.embed(input_ids)
            h = inputs_embeds
            per_layer = None
            if self.config.has_per_layer_inputs:
                if per_layer_token_inputs is None:
                    if input_ids is None:
                        raise ValueError("a model with per-layer embeddings needs input_ids or per_layer_token_inputs")
                    per_layer_token_inputs = self.per_layer_token_inputs(input_ids)
                per_layer = self.per_layer_inputs(h, per_layer_token_inputs)

        offset = cache[0].offset if cache is not None else 0
        masks = self.make_masks(h, cache, offset, vision_blocks)
        # A decode step runs the layers as compiled pieces (see _pieces), with its position as an
        # array so that one trace serves every step (on any thread: see ops/compiled.py).
        one = h.shape[1] == 1
        position = mx.array(offset, dtype=mx.int32) if one else offset
        start, end = self._span()
        kvs: dict = {}
        unread = []  # copies only a drafter reads: h depends on them, so that decoding without it updates them too
        for source, (k, v) in received.items():
            if not stage.cached_here(source):  # passing through
                continue
            if cache is None:
                kvs[source] = (k, v)
            elif not isinstance(cache[source], PassedLayerCache):  # this process mirrors the source layer's cache
                # (a drafter's source has none in a cache made before the drafter came: that one only counts)
                kvs[source] = cache[source].update_and_fetch(k, v)
                if not stage.owns_consumer(source):
                    unread.append(kvs[source])
        new_kv = dict(received)  # what the next process may need
        first, joins = self._pieces(one_token=one)
        q, k, v = first(h, position)
        for i in range(start, end):
            spec = self.layers[i].spec
            if spec.is_kv_shared:
                # KV-shared layer: attend over the source layer's cached K/V (already normed and rotated).
                k, v = kvs[spec.kv_source]
            else:
                new_kv[i] = (k, v)
                if cache is not None:
                    k, v = cache[i].update_and_fetch(k, v)
            kvs[i] = (k, v)
            attn = ops.attention(q, k, v, scale=1.0, mask=masks[spec.layer_type])
            ple = per_layer[:, :, i - per_layer_base, :] if per_layer is not None else None
            h, (q, k, v) = joins[i - start](h, attn, ple, position)
        if self.tensor_group is not None and self.traffic is not None:
            self.traffic.add(h.nbytes * self.sums_per_pass, self.sums_per_pass)
        if stage is not None:
            if not stage.is_last:
                h = stage.send(h, per_layer, per_layer_base, new_kv, cache)
            if stage.shared_sources:  # a drafter's sources, to the processes the pipeline does not bring them to
                h = stage.share_sources(h, arrived if stage.is_last else h, new_kv, received, cache, self.layers)
            if unread:
                h = mx.depends(h, [a for _, a in tree_flatten(unread)])
            h = stage.from_last(h)
            stage.advance_passed(cache, h.shape[1])
        return ops.rms_norm(h, self.norm.weight, self.config.rms_norm_eps)

__all__ = ["materialize", "TextModel", "DecoderLayer", "Attention", "MLP", "Router", "Experts", "make_rope", "softcap", "FULL", "SLIDING"]
