"""Gemma 4 12B, the unified (encoder-free) model: transformers' ``Gemma4UnifiedForConditionalGeneration``.

Written as its diff from :class:`~gemma4_mlx.models.gemma4.Gemma4Model`, as transformers'
``modular_gemma4_unified.py`` is. The decoder, caches, masks and LM head are Gemma 4's (a dense
decoder without per-layer embeddings or MoE; image and video soft tokens attend to each other
inside their block, as in the 26B/31B). What differs is how media enter it, with no encoder tower:

* an image or video frame is cut into 48x48 px patches (the processor's 16 px patches merged 3x3),
  each patch's 6912 raw values go through LayerNorm -> Linear -> LayerNorm, get a factorized 2D
  position embedding (one learned row per x and per y, summed) and a LayerNorm
  (:class:`PatchEmbedder`, ``vision_embedder``), then the RMSNorm -> Linear embedder into the text
  width (``embed_vision``);
* audio is 40 ms frames of the raw 16 kHz waveform (640 samples), each through that same
  RMSNorm -> Linear embedder: one soft token per frame, no downsampling.

Every step works on each patch or frame alone, so padding is dropped before embedding rather than
after (transformers embeds the padding, then drops it): the same values for less work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import ModelConfig, split_known_keys
from ..errors import ConfigError, MediaError
from .gemma4 import Gemma4Model
from .multimodal import MultimodalEmbedder


@dataclass
class UnifiedVisionConfig:
    """``vision_config`` of a ``gemma4_unified`` checkpoint (transformers' ``Gemma4UnifiedVisionConfig``)."""

    patch_size: int = 16
    pooling_kernel_size: int = 3
    mm_embed_dim: int = 3840
    mm_posemb_size: int = 1120
    output_proj_dims: int = 3840
    rms_norm_eps: float = 1e-6
    extra: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "UnifiedVisionConfig":
        known, extra = split_known_keys(cls, raw, "vision_config")
        config = cls(**known, extra=extra)
        if config.output_proj_dims != config.mm_embed_dim:
            # transformers feeds the mm_embed_dim-wide patch embeddings to an embedder of this width.
            raise ConfigError(f"vision_config.output_proj_dims ({config.output_proj_dims}) must equal mm_embed_dim ({config.mm_embed_dim})")
        return config

    @property
    def patch_dims(self) -> int:
        """Raw values per merged patch: (16 px * 3)^2 * RGB = 6912."""
        return (self.patch_size * self.pooling_kernel_size) ** 2 * 3


@dataclass
class UnifiedAudioConfig:
    """``audio_config`` of a ``gemma4_unified`` checkpoint: one soft token per ``audio_embed_dim`` samples."""

    audio_embed_dim: int = 640
    rms_norm_eps: float = 1e-6
    extra: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "UnifiedAudioConfig":
        known, extra = split_known_keys(cls, raw, "audio_config")
        return cls(**known, extra=extra)


def _compute_dtype(linear: nn.Module) -> mx.Dtype:
    """The float dtype a (possibly quantized) linear computes in: raw pixels and samples come as
    float32 and are cast to it, as transformers casts them to its weights' dtype."""
    return linear.scales.dtype if "scales" in linear else linear.weight.dtype


class PatchEmbedder(nn.Module):
    """``vision_embedder``: merged pixel patches [N, 6912] at (x, y) positions [N, 2] -> [N, mm_embed_dim],
    which ``embed_vision`` (RMSNorm -> Linear) maps into the text width. Named as in the checkpoint."""

    def __init__(self, config: UnifiedVisionConfig):
        super().__init__()
        dims = config.mm_embed_dim
        # torch's nn.LayerNorm default eps (1e-5), which transformers' embedder keeps.
        self.patch_ln1 = nn.LayerNorm(config.patch_dims, eps=1e-5)
        self.patch_dense = nn.Linear(config.patch_dims, dims)
        self.patch_ln2 = nn.LayerNorm(dims, eps=1e-5)
        self.pos_embedding = mx.zeros((config.mm_posemb_size, 2, dims))  # [position, axis (x, y), dims]
        self.pos_norm = nn.LayerNorm(dims, eps=1e-5)

    def __call__(self, patches: mx.array, positions: mx.array) -> mx.array:
        # LayerNorm ignores a shift, so the patches are centred first (in float32): MLX's float32 mean of
        # 6912 values is off by ~1e-7 of their size, which eps = 1e-5 blows up on near-flat patches (sky,
        # a white page) to 2e-4..5e-3 relative against torch; centred, the error stays under 1e-5.
        patches = patches.astype(mx.float32)
        patches = patches - patches.mean(axis=-1, keepdims=True)
        h = self.patch_ln2(self.patch_dense(self.patch_ln1(patches.astype(_compute_dtype(self.patch_dense)))))
        h = h + self.pos_embedding[positions[:, 0], 0] + self.pos_embedding[positions[:, 1], 1]
        return self.pos_norm(h)


def real_patches(pixel_values, position_ids, table_size: int) -> tuple[mx.array, mx.array]:
    """The non-padding patches of a batch of images or frames ([B, P, D] and positions [B, P, 2],
    padding at (-1, -1)), flattened in order: [N, D] and [N, 2]. Positions outside the embedding
    table raise :class:`MediaError` (MLX would read out of bounds silently)."""
    pos = np.asarray(position_ids).astype(np.int64)
    pixel_values = mx.array(pixel_values)
    if pos.ndim == 2:
        pos, pixel_values = pos[None], pixel_values[None]
    keep = ~(pos == -1).all(axis=-1)
    pos = pos[keep]
    if len(pos) and (pos.min() < 0 or pos.max() >= table_size):
        raise MediaError(f"patch positions reach {pos.max()}, this model has position embeddings for 0..{table_size - 1}: crop the image")
    flat = pixel_values.reshape(-1, pixel_values.shape[-1])[mx.array(np.flatnonzero(keep.reshape(-1)), dtype=mx.int32)]
    return flat, mx.array(pos, dtype=mx.int32)


class Gemma4UnifiedModel(Gemma4Model):
    """Gemma 4 12B: :class:`Gemma4Model` with the encoder-free embedders (see the module docstring)."""

    def __init__(self, config: ModelConfig):
        # The towers of Gemma4Model are built from vision_config/audio_config; this model has none.
        super().__init__(ModelConfig(**{**config.__dict__, "vision_config": None, "audio_config": None}))
        self.config = config
        self.language_model.blocks_in_every_layer = True
        hidden = config.text_config.hidden_size
        if config.vision_config:
            self.vision_config = UnifiedVisionConfig.from_dict(config.vision_config)
            self.vision_embedder = PatchEmbedder(self.vision_config)
            self.embed_vision = MultimodalEmbedder(self.vision_config.output_proj_dims, hidden, self.vision_config.rms_norm_eps)
        if config.audio_config:
            ac = UnifiedAudioConfig.from_dict(config.audio_config)
            self.embed_audio = MultimodalEmbedder(ac.audio_embed_dim, hidden, ac.rms_norm_eps)

    def encode_images(self, pixel_values, position_ids) -> mx.array:
        """Soft tokens of images or video frames, in order, padding dropped: [N, text hidden]."""
        patches, positions = real_patches(pixel_values, position_ids, self.vision_config.mm_posemb_size)
        return self.embed_vision(self.vision_embedder(patches, positions))

    def encode_audio(self, input_features, input_features_mask) -> mx.array:
        """Soft tokens of audio clips (frames [B, T, 640], mask [B, T]), in order, padding dropped."""
        frames = mx.array(input_features)
        keep = np.flatnonzero(np.asarray(input_features_mask).reshape(-1))
        frames = frames.reshape(-1, frames.shape[-1])[mx.array(keep, dtype=mx.int32)]
        return self.embed_audio(frames.astype(_compute_dtype(self.embed_audio.embedding_projection)))
