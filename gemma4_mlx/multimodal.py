"""Pieces shared by the vision and audio paths: the embedder into text space and the media error."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class MediaError(ValueError):
    """An image, audio clip or video that cannot be read, or that the model cannot take."""


class MultimodalEmbedder(nn.Module):
    """``embed_vision`` / ``embed_audio``: unscaled RMSNorm, then a linear map into the text hidden size."""

    def __init__(self, in_dims: int, text_hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.embedding_projection = nn.Linear(in_dims, text_hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding_projection(mx.fast.rms_norm(x, None, self.eps))
