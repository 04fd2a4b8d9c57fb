"""Pieces shared by the vision and audio paths: clipped linears and the embedder into text space."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn


class ClippableLinear(nn.Module):
    """A bias-free linear whose input and output are clamped to bounds stored in the checkpoint."""

    def __init__(self, in_dims: int, out_dims: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(in_dims, out_dims, bias=False)
        if clipped:
            self.input_min = mx.array(-math.inf)
            self.input_max = mx.array(math.inf)
            self.output_min = mx.array(-math.inf)
            self.output_max = mx.array(math.inf)

    def __call__(self, x: mx.array) -> mx.array:
        if "input_min" not in self:
            return self.linear(x)
        x = mx.clip(x, self.input_min.astype(x.dtype), self.input_max.astype(x.dtype))
        y = self.linear(x)
        return mx.clip(y, self.output_min.astype(y.dtype), self.output_max.astype(y.dtype))


class MultimodalEmbedder(nn.Module):
    """``embed_vision`` / ``embed_audio``: unscaled RMSNorm, then a linear map into the text hidden size."""

    def __init__(self, in_dims: int, text_hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.embedding_projection = nn.Linear(in_dims, text_hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding_projection(mx.fast.rms_norm(x, None, self.eps))

