"""The Gemma 4 vision tower: a ViT over 16x16 patches with 2D RoPE, pooled 3x3 into soft tokens.

Both families share the code: the small ViT of E2B/E4B (clipped linears) and the large ViT of
26B-A4B/31B (``standardize``). Ground truth is transformers 5.23's ``Gemma4VisionModel``; module and
parameter names follow it, so ``model.vision_tower.<name>`` in a checkpoint is ``<name>`` here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import ops
from ..config import split_known_keys
from ..errors import MediaError
from .multimodal import ClippableLinear, MultimodalEmbedder

_ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu": nn.gelu, "silu": nn.silu, "relu": nn.relu}
_CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


@dataclass
class VisionConfig:
    """transformers' ``Gemma4VisionConfig``; unknown keys are kept in ``extra``."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131_072
    attention_bias: bool | None = False
    attention_dropout: float | None = 0.0
    rope_parameters: dict[str, Any] | None = None
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    initializer_range: float = 0.02
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "VisionConfig":
        known, extra = split_known_keys(cls, raw, "vision_config")
        return cls(**known, extra=extra)

    @property
    def rope_theta(self) -> float:
        # transformers' default for the vision tower is 100 (axial RoPE), not the text 10_000.
        params = self.rope_parameters or {}
        return float(params.get("rope_theta", self.extra.get("rope_theta", 100.0)))


def rope_2d(x: mx.array, offsets: mx.array, base: float) -> mx.array:
    """Axial RoPE: [B, L, N, D] -> [B, N, L, D], first half of D turned by x, second half by y.

    Each half is rotate-half RoPE over D/2 dims with its own position per patch. ``mx.fast.rope``
    takes one position offset per batch row, so every (half, patch) becomes its own row of length 1;
    ``offsets`` is [2*B*L]: all x positions, then all y positions.
    """
    B, L, N, D = x.shape
    h = x.reshape(B * L, N, 2, D // 2).transpose(2, 0, 1, 3).reshape(2 * B * L, N, 1, D // 2)
    h = mx.fast.rope(h, D // 2, traditional=False, base=base, scale=1.0, offset=offsets)
    return h.reshape(2, B, L, N, D // 2).transpose(1, 3, 2, 0, 4).reshape(B, N, L, D)


class Attention(nn.Module):
    """Bidirectional self-attention: q/k norms scaled, v norm unscaled, 2D RoPE, scale 1.0."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.head_dim, self.eps, self.theta = cfg.head_dim, cfg.rms_norm_eps, cfg.rope_theta
        h, n, kv, clip = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.use_clipped_linears
        self.q_proj = ClippableLinear(h, n * self.head_dim, clip)
        self.k_proj = ClippableLinear(h, kv * self.head_dim, clip)
        self.v_proj = ClippableLinear(h, kv * self.head_dim, clip)
        self.o_proj = ClippableLinear(n * self.head_dim, h, clip)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=self.eps)

    def __call__(self, x: mx.array, offsets: mx.array, mask: mx.array | None) -> mx.array:
        B, L, _ = x.shape
        q = rope_2d(ops.rms_norm(self.q_proj(x).reshape(B, L, -1, self.head_dim), self.q_norm.weight, self.eps), offsets, self.theta)
        k = rope_2d(ops.rms_norm(self.k_proj(x).reshape(B, L, -1, self.head_dim), self.k_norm.weight, self.eps), offsets, self.theta)
        v = ops.rms_norm(self.v_proj(x).reshape(B, L, -1, self.head_dim), None, self.eps).transpose(0, 2, 1, 3)
        out = ops.attention(q, k, v, scale=1.0, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        h, i, clip = cfg.hidden_size, cfg.intermediate_size, cfg.use_clipped_linears
        self.gate_proj = ClippableLinear(h, i, clip)
        self.up_proj = ClippableLinear(h, i, clip)
        self.down_proj = ClippableLinear(i, h, clip)
        self.act = _ACTIVATIONS[cfg.hidden_activation]

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class EncoderLayer(nn.Module):
    """Sandwich norms around attention and MLP (no layer scalar in the vision tower)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(h, eps=eps)
        self.eps = eps

    def __call__(self, x: mx.array, offsets: mx.array, mask: mx.array | None) -> mx.array:
        eps = self.eps
        h = self.self_attn(ops.rms_norm(x, self.input_layernorm.weight, eps), offsets, mask)
        x = ops.add_rms_norm(x, h, self.post_attention_layernorm.weight, eps)
        h = self.mlp(ops.rms_norm(x, self.pre_feedforward_layernorm.weight, eps))
        return ops.add_rms_norm(x, h, self.post_feedforward_layernorm.weight, eps)


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = [EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]

    def __call__(self, x: mx.array, offsets: mx.array, mask: mx.array | None) -> mx.array:
        for layer in self.layers:
            x = layer(x, offsets, mask)
        return x


class PatchEmbedder(nn.Module):
    """Pixels in [0, 1] -> [-1, 1] -> ``input_proj``, plus a learned x embedding and a y embedding."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=False)
        self.position_embedding_table = mx.zeros((2, cfg.position_embedding_size, cfg.hidden_size))

    def __call__(self, pixel_values: mx.array, positions: mx.array, padding: mx.array) -> mx.array:
        x = self.input_proj((2 * (pixel_values - 0.5)).astype(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        pos = table[0][positions[..., 0]] + table[1][positions[..., 1]]  # positions: padding clamped to 0
        return x + mx.where(padding[..., None], 0, pos).astype(x.dtype)


def pooling_cells(position_ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """transformers' ``_avg_pool_by_positions`` index math, on the host.

    Returns the pooled cell of every patch [B, P] (row-major over the pooled grid; padding clamps to
    (0, 0) and so falls in cell 0), the flat indices ``b * (P // k**2) + cell`` of the cells that get
    any patch (transformers' pooler mask; in image then cell order), and their count per image.
    """
    B, P = position_ids.shape[:2]
    length = P // (k * k)
    pos = np.maximum(position_ids, 0)
    width = pos[..., 0].max(axis=-1, keepdims=True) + 1
    cell = pos[..., 0] // k + (width // k) * (pos[..., 1] // k)
    if cell.max(initial=0) >= length:
        raise ValueError(f"patch positions do not fit {length} pooled cells of {k}x{k} patches")
    keep = np.unique(cell + np.arange(B)[:, None] * length)
    return cell, keep, np.bincount(keep // length, minlength=B)


class VisionTower(nn.Module):
    """transformers' ``Gemma4VisionModel``: patches [B, P, 3*16*16] with (x, y) positions [B, P, 2]
    (padding (-1, -1)) -> soft tokens [total, hidden], padding stripped, images in order."""

    def __init__(self, config: VisionConfig | dict[str, Any]):
        super().__init__()
        self.config = config = config if isinstance(config, VisionConfig) else VisionConfig.from_dict(config)
        if config.head_dim % 4:
            raise ValueError(f"2D RoPE needs head_dim divisible by 4, got {config.head_dim}")
        self.patch_embedder = PatchEmbedder(config)
        self.encoder = Encoder(config)
        if config.standardize:
            self.std_bias = mx.zeros((config.hidden_size,))
            self.std_scale = mx.ones((config.hidden_size,))

    def __call__(self, pixel_values, position_ids) -> mx.array:
        return self.features(pixel_values, position_ids)[0]

    def features(self, pixel_values, position_ids) -> tuple[mx.array, list[int]]:
        """Soft tokens [total, hidden] and the number each image contributes."""
        # Positions stay on the host: the pooling and stripping indices are computed from them.
        pos_np = np.asarray(position_ids).astype(np.int64)
        pixel_values = mx.array(pixel_values)
        padding_np = (pos_np == -1).all(axis=-1)
        B, P = padding_np.shape
        pos_np = np.maximum(pos_np, 0)
        if pos_np.max(initial=0) >= self.config.position_embedding_size:
            # MLX gathers do not check bounds: an out-of-table position would read garbage.
            size = self.config.position_embedding_size
            raise MediaError(f"an image spans {pos_np.max() + 1} patches; the vision tower has positions for {size}")
        padding = mx.array(padding_np)

        x = self.patch_embedder(pixel_values, mx.array(pos_np.astype(np.int32)), padding)
        offsets = mx.array(np.concatenate([pos_np[..., 0].reshape(-1), pos_np[..., 1].reshape(-1)]).astype(np.int32))
        # Padding patches are masked as keys; their own outputs are zeroed before pooling.
        mask = mx.array(~padding_np)[:, None, None, :] if padding_np.any() else None
        x = self.encoder(x, offsets, mask)
        return self._pool(x, padding, pos_np)

    def _pool(self, x: mx.array, padding: mx.array, pos_np: np.ndarray) -> tuple[mx.array, list[int]]:
        """Average k x k patches by position, * sqrt(hidden) in float32, standardize, strip padding."""
        cfg = self.config
        B, P, H = x.shape
        k = cfg.pooling_kernel_size
        x = mx.where(padding[..., None], 0, x)  # padding falls into cell 0: it must add nothing there
        if k == 1:
            keep = np.flatnonzero(~np.array(padding).reshape(-1))
            counts = (~np.array(padding)).sum(axis=-1)
            pooled = x.reshape(-1, H).astype(mx.float32)
        else:
            cell, keep, counts = pooling_cells(pos_np, k)
            length = P // (k * k)
            index = mx.array((cell + np.arange(B)[:, None] * length).reshape(-1).astype(np.int32))
            pooled = mx.zeros((B * length, H), dtype=mx.float32).at[index].add(x.reshape(-1, H).astype(mx.float32))
            # transformers averages in float32, casts back to the working dtype, then scales in float32.
            pooled = (pooled / (k * k)).astype(x.dtype).astype(mx.float32)
        out = pooled[mx.array(keep.astype(np.int32))] * math.sqrt(H)
        if cfg.standardize:
            out = (out - self.std_bias.astype(mx.float32)) * self.std_scale.astype(mx.float32)
        return out.astype(x.dtype), [int(c) for c in counts]

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        """The tower's checkpoint tensors (names relative to the tower) -> this module's: names map
        1:1; the rotary ``inv_freq`` buffers are dropped (recomputed), and so are the clip bounds when
        the tower has no clipped linears (transformers ignores them then)."""
        return {
            k: v
            for k, v in weights.items()
            if "rotary_emb." not in k and (self.config.use_clipped_linears or not k.endswith(_CLIP_BOUNDS))
        }


def encode_images(tower: VisionTower, embedder: MultimodalEmbedder, pixel_values, position_ids) -> mx.array:
    """Soft tokens in text space [total soft tokens, text hidden], images in order: transformers'
    ``torch.cat(get_image_features(pixel_values, image_position_ids).pooler_output)``."""
    pos = np.asarray(position_ids).astype(np.int64)
    pixel_values = mx.array(pixel_values)
    if pos.ndim == 2:
        pos, pixel_values = pos[None], pixel_values[None]
    B, P = pos.shape[:2]
    k2 = tower.config.pooling_kernel_size**2
    real = ~(pos == -1).all(axis=-1)
    # Trailing padding only adds masked keys and discarded queries, so each image runs on its own
    # patches (same-length images batched together), which saves the padded attention.
    lengths = []
    for i, n in enumerate(real.sum(axis=-1)):
        n = int(n)
        lengths.append(n if n and n % k2 == 0 and real[i, :n].all() else P)
    feats: list[mx.array | None] = [None] * B
    heads = tower.config.num_attention_heads
    for L in sorted(set(lengths)):
        group = [i for i in range(B) if lengths[i] == L]
        step = max(1, (1 << 30) // (4 * heads * L * L))  # bound the attention scores to ~1 GiB a call
        for s in range(0, len(group), step):
            chunk = group[s : s + step]
            out, counts = tower.features(pixel_values[mx.array(chunk)][:, :L], pos[chunk, :L])
            mx.eval(out)
            for i, f in zip(chunk, mx.split(out, np.cumsum(counts)[:-1].tolist()) if len(chunk) > 1 else [out]):
                feats[i] = f
    return embedder(mx.concatenate(feats, axis=0))
