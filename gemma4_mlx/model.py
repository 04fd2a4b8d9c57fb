"""The top-level Gemma 4 model: text decoder, LM head with logit softcap, and the cache factory.

``Gemma4Model(input_ids)`` returns logits ``[B, L, vocab]``; with ``cache=model.make_cache()`` it
decodes incrementally. The module tree mirrors the Hugging Face checkpoint
(``model.language_model.*`` -> ``language_model.*``), so weights map by name.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn

from .cache import make_cache
from .config import ModelConfig
from .text import TextModel, softcap


class TokenIdError(ValueError):
    """A token id outside the model's vocabulary."""


def check_token_ids(input_ids, vocab_size: int) -> None:
    """Raise :class:`TokenIdError` if any id is outside ``[0, vocab_size)`` (forces an eval)."""
    ids = mx.array(input_ids)
    if ids.size == 0:
        raise ValueError("empty input: at least one token id is needed")
    lo, hi = mx.min(ids).item(), mx.max(ids).item()
    if lo < 0 or hi >= vocab_size:
        bad = hi if hi >= vocab_size else lo
        raise TokenIdError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


class Gemma4Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.text_config = config.text_config
        self.language_model = TextModel(config.text_config)
        if not config.text_config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        # Multimodal placeholder ids; the text decoder sees the pad token there (as in HF), and the
        # multimodal model overwrites those embeddings with soft tokens.
        self._media_token_ids = (
            [i for i in (config.image_token_id, config.video_token_id, config.audio_token_id) if i is not None]
            if config.model_type == "gemma4"
            else []
        )

    @property
    def layers(self):
        return self.language_model.layers

    def adapt_to_device(self) -> None:
        """Work around backend limits of the current device (see ``Experts.adapt_to_cpu``)."""
        if mx.default_device().type == mx.DeviceType.cpu:
            changed = [layer.experts.adapt_to_cpu() for layer in self.layers if layer.has_moe]
            if any(changed):
                warnings.warn("MLX's CPU backend needs float32 experts: half-precision expert weights were upcast")

    def make_cache(self) -> list:
        """A fresh KV cache for incremental decoding (see :mod:`gemma4_mlx.cache`)."""
        return make_cache(self.text_config)

    def media_mask(self, input_ids: mx.array) -> mx.array | None:
        """True at image/video/audio placeholder tokens (None for text-only checkpoints)."""
        mask = None
        for token_id in self._media_token_ids:
            m = input_ids == token_id
            mask = m if mask is None else mask | m
        return mask

    def text_token_ids(self, input_ids: mx.array) -> mx.array:
        """Input ids with placeholders replaced by the pad id (placeholders may lie outside the vocab)."""
        mask = self.media_mask(input_ids)
        return input_ids if mask is None else mx.where(mask, self.text_config.pad_token_id or 0, input_ids)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.text_config.tie_word_embeddings:
            out = self.language_model.embed_tokens.as_linear(hidden)
        else:
            out = self.lm_head(hidden)
        cap = self.text_config.final_logit_softcapping
        return softcap(out, cap) if cap else out

    def __call__(
        self,
        input_ids: mx.array | None = None,
        cache: list | None = None,
        inputs_embeds: mx.array | None = None,
        per_layer_token_inputs: mx.array | None = None,
    ) -> mx.array:
        """Logits for ``input_ids`` [B, L] (or precomputed ``inputs_embeds`` [B, L, hidden]).

        Prompts (L > 1) are checked against the vocabulary; single decode tokens are not, so
        the decode loop never waits on the host.
        """
        if input_ids is not None:
            if not isinstance(input_ids, mx.array):
                input_ids = mx.array(input_ids)
            if input_ids.ndim == 1:
                input_ids = input_ids[None]
            input_ids = self.text_token_ids(input_ids)
            if input_ids.shape[-1] > 1:
                check_token_ids(input_ids, self.text_config.vocab_size)
        elif inputs_embeds is None:
            raise ValueError("pass input_ids or inputs_embeds")
        h = self.language_model(input_ids, cache, inputs_embeds, per_layer_token_inputs)
        return self.logits(h)
