"""The Gemma 4 audio tower (E2B/E4B): a USM-style Conformer over log-mel features.

Two stride-2 conv blocks turn [T, 128] mel frames into T/4 tokens, then each Conformer layer runs a
half-step FFN, chunked local self-attention with relative positions, a light conv block and a
second half-step FFN. ``output_proj`` and ``embed_audio`` map the tokens into text space. Ground
truth is transformers 5.23's ``Gemma4AudioModel``; module and parameter names follow it, so
``model.audio_tower.<name>`` in a checkpoint is ``<name>`` here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..config import split_known_keys
from .multimodal import ClippableLinear, MultimodalEmbedder

_ACTIVATIONS = {"silu": nn.silu, "swish": nn.silu, "gelu": nn.gelu, "gelu_pytorch_tanh": nn.gelu_approx, "relu": nn.relu}


@dataclass
class AudioConfig:
    """transformers' ``Gemma4AudioConfig``; unknown keys are kept in ``extra``."""

    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    hidden_act: str = "silu"
    subsampling_conv_channels: list[int] = field(default_factory=lambda: [128, 32])
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536
    initializer_range: float = 0.02
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "AudioConfig":
        known, extra = split_known_keys(cls, raw, "audio_config")
        if "subsampling_conv_channels" in known:
            known["subsampling_conv_channels"] = list(known["subsampling_conv_channels"])
        return cls(**known, extra=extra)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _clip(x: mx.array, limit: float) -> mx.array:
    """transformers' ``gradient_clipping`` clamp, limited to the dtype's range (1e10 overflows fp16)."""
    limit = min(limit, float(mx.finfo(x.dtype).max))
    return mx.clip(x, -limit, limit)


class SubsampleLayer(nn.Module):
    """Mask padding frames, 3x3 stride-2 conv over (time, freq), LayerNorm over channels, ReLU."""

    def __init__(self, in_channels: int, out_channels: int, eps: float):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(out_channels, eps=eps, bias=False)

    def __call__(self, x: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
        x = x * mask[:, :, None, None].astype(x.dtype)  # x: [B, T, F, C]
        x = nn.relu(self.norm(self.conv(x)))
        return x, mask[:, ::2]


class SubsampleConvProjection(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        c0, c1 = config.subsampling_conv_channels
        self.layer0 = SubsampleLayer(1, c0, config.rms_norm_eps)
        self.layer1 = SubsampleLayer(c0, c1, config.rms_norm_eps)
        # transformers sizes this (c0 // 4) * c1, which is (mel bins / 4) * c1 only when c0 == 128.
        self.input_proj_linear = nn.Linear((c0 // 4) * c1, config.hidden_size, bias=False)

    def __call__(self, features: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
        x = features[..., None].astype(self.layer0.conv.weight.dtype)
        x, mask = self.layer0(x, mask)
        x, mask = self.layer1(x, mask)
        B, T = x.shape[:2]
        return self.input_proj_linear(x.reshape(B, T, -1)), mask  # flattened (freq, channel)


class FeedForward(nn.Module):
    """Macaron half-step FFN: x + residual_weight * norm(W2 act(W1 norm(x)))."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        h = config.hidden_size
        self.ffw_layer_1 = ClippableLinear(h, 4 * h, config.use_clipped_linears)
        self.ffw_layer_2 = ClippableLinear(4 * h, h, config.use_clipped_linears)
        # transformers builds these two norms with the default eps (1e-6), not rms_norm_eps.
        self.pre_layer_norm = nn.RMSNorm(h, eps=1e-6)
        self.post_layer_norm = nn.RMSNorm(h, eps=1e-6)
        self.act = _ACTIVATIONS[config.hidden_act]
        self.clip = config.gradient_clipping
        self.residual_weight = config.residual_weight

    def __call__(self, x: mx.array) -> mx.array:
        h = self.ffw_layer_2(self.act(self.ffw_layer_1(self.pre_layer_norm(_clip(x, self.clip)))))
        return x + self.post_layer_norm(_clip(h, self.clip)) * self.residual_weight


class Attention(nn.Module):
    """Chunked local attention: each chunk of queries sees a window of keys around it, with
    Transformer-XL relative position logits, a learned per-dim query scale and a logit softcap."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        h, self.n_heads, self.head_dim = config.hidden_size, config.num_attention_heads, config.head_dim
        self.chunk = config.attention_chunk_size
        self.past = config.attention_context_left - 1
        self.future = config.attention_context_right
        self.window = self.chunk + self.past + self.future
        self.softcap = config.attention_logit_cap
        self.invalid = config.attention_invalid_logits_value
        # log2-based scales of the original implementation; softplus(0) * k_scale == 1.
        self.q_scale = (self.head_dim**-0.5) / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        self.q_proj = ClippableLinear(h, h, config.use_clipped_linears)
        self.k_proj = ClippableLinear(h, h, config.use_clipped_linears)
        self.v_proj = ClippableLinear(h, h, config.use_clipped_linears)
        self.post = ClippableLinear(h, h, config.use_clipped_linears)
        self.relative_k_proj = nn.Linear(h, h, bias=False)
        self.per_dim_scale = mx.zeros((self.head_dim,))

    def _context(self, x: mx.array, num_blocks: int) -> mx.array:
        """[B, T, H, D] -> overlapping key windows [B, H, blocks, window, D], zero outside [0, T)."""
        B, T = x.shape[:2]
        x = mx.pad(x, [(0, 0), (self.past, num_blocks * self.chunk + self.future - T), (0, 0), (0, 0)])
        idx = (np.arange(num_blocks)[:, None] * self.chunk + np.arange(self.window)[None]).reshape(-1)
        x = mx.take(x, mx.array(idx), axis=1).reshape(B, num_blocks, self.window, self.n_heads, self.head_dim)
        return x.transpose(0, 3, 1, 2, 4)

    def _rel_shift(self, x: mx.array) -> mx.array:
        """[..., chunk, P] logits by relative offset -> [..., chunk, window] by key slot (row i shifts by i)."""
        *lead, C, P = x.shape
        x = mx.pad(x, [(0, 0)] * (len(lead) + 1) + [(0, self.window + 1 - P)])
        x = x.reshape(*lead, C * (self.window + 1))[..., : C * self.window]
        return x.reshape(*lead, C, self.window)

    def __call__(self, x: mx.array, pos_emb: mx.array, mask: mx.array) -> mx.array:
        B, T, _ = x.shape
        H, D, C = self.n_heads, self.head_dim, self.chunk
        nb = -(-T // C)
        shape = (B, T, H, D)
        q = self.q_proj(x).astype(mx.float32).reshape(shape)
        q = q * (self.q_scale * nn.softplus(self.per_dim_scale.astype(mx.float32)))
        k = self.k_proj(x).astype(mx.float32).reshape(shape) * self.k_scale
        v = self.v_proj(x).astype(mx.float32).reshape(shape)

        q = mx.pad(q, [(0, 0), (0, nb * C - T), (0, 0), (0, 0)]).reshape(B, nb, C, H, D).transpose(0, 3, 1, 2, 4)
        k, v = self._context(k, nb), self._context(v, nb)
        rel_k = self.relative_k_proj(pos_emb).astype(mx.float32).reshape(-1, H, D).transpose(1, 2, 0)  # [H, D, P]

        logits = q @ k.swapaxes(-1, -2)  # content term [B, H, nb, C, W]
        logits = logits + self._rel_shift((q.reshape(B, H, nb * C, D) @ rel_k).reshape(B, H, nb, C, -1))
        logits = mx.tanh(logits / self.softcap) * self.softcap
        logits = mx.where(mask, logits, self.invalid)
        out = mx.softmax(logits, axis=-1, precise=True) @ v  # [B, H, nb, C, D]
        out = out.transpose(0, 2, 3, 1, 4).reshape(B, nb * C, H * D)[:, :T]
        return self.post(out.astype(x.dtype))


class LightConv(nn.Module):
    """GLU, causal depthwise conv, norm, activation, projection; residual around it all."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.kernel = config.conv_kernel_size
        self.linear_start = ClippableLinear(h, 2 * h, config.use_clipped_linears)
        self.linear_end = ClippableLinear(h, h, config.use_clipped_linears)
        self.depthwise_conv1d = nn.Conv1d(h, h, self.kernel, groups=h, bias=False)
        self.pre_layer_norm = nn.RMSNorm(h, eps=eps)
        self.conv_norm = nn.RMSNorm(h, eps=eps)
        self.act = _ACTIVATIONS[config.hidden_act]
        self.clip = config.gradient_clipping

    def __call__(self, x: mx.array) -> mx.array:
        a, b = mx.split(self.linear_start(self.pre_layer_norm(x)), 2, axis=-1)
        h = a * mx.sigmoid(b)
        h = self.depthwise_conv1d(mx.pad(h, [(0, 0), (self.kernel - 1, 0), (0, 0)]))  # causal: pad the past
        h = self.act(self.conv_norm(_clip(h, self.clip)))
        return x + self.linear_end(h)


class ConformerLayer(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        h = config.hidden_size
        self.feed_forward1 = FeedForward(config)
        self.feed_forward2 = FeedForward(config)
        self.self_attn = Attention(config)
        self.lconv1d = LightConv(config)
        self.norm_pre_attn = nn.RMSNorm(h, eps=1e-6)
        self.norm_post_attn = nn.RMSNorm(h, eps=1e-6)
        self.norm_out = nn.RMSNorm(h, eps=1e-6)
        self.clip = config.gradient_clipping

    def __call__(self, x: mx.array, pos_emb: mx.array, mask: mx.array) -> mx.array:
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(_clip(x, self.clip)), pos_emb, mask)
        x = x + self.norm_post_attn(_clip(h, self.clip))
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(_clip(x, self.clip))


class AudioTower(nn.Module):
    """transformers' ``Gemma4AudioModel``: mel features [B, T, 128] -> tokens [B, ~T/4, output_proj_dims]."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        self.config = config
        self.subsample_conv_projection = SubsampleConvProjection(config)
        self.layers = [ConformerLayer(config) for _ in range(config.num_hidden_layers)]
        self.output_proj = nn.Linear(config.hidden_size, config.output_proj_dims, bias=True)
        self._pos_emb = self._relative_positions(config)

    @staticmethod
    def _relative_positions(config: AudioConfig) -> mx.array:
        """Sinusoids [sin..., cos...] for distances window//2 .. 0 (transformers' rel_pos_enc)."""
        window = config.attention_chunk_size + config.attention_context_left - 1 + config.attention_context_right
        n = config.hidden_size // 2
        inv = mx.exp(mx.arange(n, dtype=mx.float32) * -(math.log(10_000.0) / max(n - 1, 1)))
        t = mx.arange(window // 2, -1, -1, dtype=mx.float32)[:, None] * inv[None]
        return mx.concatenate([mx.sin(t), mx.cos(t)], axis=-1)

    def _block_mask(self, valid: mx.array) -> mx.array:
        """[B, T] valid tokens -> [B, 1, blocks, chunk, window] keys each query may attend to."""
        cfg = self.config
        B, T = valid.shape
        C, past = cfg.attention_chunk_size, cfg.attention_context_left - 1
        W = C + past + cfg.attention_context_right
        nb = -(-T // C)
        q = np.arange(nb)[:, None, None] * C + np.arange(C)[None, :, None]  # [nb, C, 1]
        kv = np.arange(nb)[:, None, None] * C - past + np.arange(W)[None, None, :]  # [nb, 1, W]
        dist = q - kv
        # transformers' sliding window: `past` keys behind including itself, `right - 1` ahead.
        ok = ((dist >= 0) & (dist < past)) | ((dist < 0) & (-dist < cfg.attention_context_right))
        ok &= (kv >= 0) & (kv < T) & (q < T)
        kv_valid = mx.take(valid, mx.array(np.clip(kv, 0, T - 1).reshape(-1)), axis=1).reshape(B, nb, 1, W)
        return (mx.array(ok)[None] & kv_valid)[:, None]

    def __call__(self, features: mx.array, mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """Tokens [B, T', output_proj_dims] and their validity [B, T'] (False on padding)."""
        features = mx.array(features)
        if mask is None:
            mask = mx.ones(features.shape[:2], dtype=mx.bool_)
        x, mask = self.subsample_conv_projection(features, mx.array(mask).astype(mx.bool_))
        attn_mask = self._block_mask(mask)
        pos_emb = self._pos_emb.astype(x.dtype)
        for layer in self.layers:
            x = layer(x, pos_emb, attn_mask)
        return self.output_proj(x), mask

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        """The tower's checkpoint tensors (names relative to the tower) -> this module's: conv kernels
        to MLX layout, recomputed buffers dropped."""
        own = dict(tree_flatten(self.parameters()))
        out = {}
        for k, v in weights.items():
            if k.endswith(("rel_pos_enc.inv_timescales", "self_attn.softcap")):
                continue  # non-persistent buffers, recomputed from the config
            if not self.config.use_clipped_linears and k.endswith(("input_min", "input_max", "output_min", "output_max")):
                continue
            if k.endswith(("conv.weight", "depthwise_conv1d.weight")) and k in own and tuple(v.shape) != tuple(own[k].shape):
                # PyTorch [out, in, kh, kw] -> MLX [out, kh, kw, in]; conv1d [out, in, k] -> [out, k, in].
                v = v.transpose(0, 2, 3, 1) if v.ndim == 4 else v.transpose(0, 2, 1)
            out[k] = v
        return out


def encode_audio(
    tower: AudioTower, embedder: MultimodalEmbedder, input_features, input_features_mask
) -> mx.array:
    """Soft tokens in text space [total valid tokens, text hidden], clips in order, padding dropped
    (transformers' ``get_audio_features`` followed by the mask stripping in ``Gemma4Model``)."""
    tokens, mask = tower(mx.array(input_features), mx.array(input_features_mask))
    keep = np.flatnonzero(np.array(mask).reshape(-1))
    # The embedder works per token, so stripping first gives the same result with less work.
    tokens = tokens.reshape(-1, tokens.shape[-1])[mx.array(keep, dtype=mx.int32)]
    return embedder(tokens)
