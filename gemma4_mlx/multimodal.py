"""Pieces shared by the vision and audio paths: clipped linears, the embedder into text space,
media sources and the media error."""

from __future__ import annotations

import math
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .errors import MediaError


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


def resolve_source(source):
    """A media source as the loaders take it: ``file://`` URLs become paths, ``http(s)://`` URLs are
    downloaded to a temporary file; anything else (paths, PIL images, arrays) passes through."""
    if not isinstance(source, str) or "://" not in source:
        return source
    url = urllib.parse.urlparse(source)
    if url.scheme == "file":
        return urllib.parse.unquote(url.path)
    if url.scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(source, timeout=30) as response:
                data = response.read()
        except OSError as e:
            raise MediaError(f"cannot download {source}: {e}") from None
        suffix = Path(url.path).suffix
        with tempfile.NamedTemporaryFile(suffix=suffix, delete=False) as f:
            f.write(data)
        return f.name
    raise MediaError(f"unsupported media URL scheme {url.scheme!r} in {source}")
