"""The top-level Gemma 4 model: text decoder, LM head with logit softcap, and the cache factory.

``Gemma4Model(input_ids)`` returns logits ``[B, L, vocab]``; with ``cache=model.make_cache()`` it
decodes incrementally. The module tree mirrors the Hugging Face checkpoint
(``model.language_model.*`` -> ``language_model.*``), so weights map by name.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import ModelConfig
from ..errors import MediaError, TokenIdError
from ..modalities import MODALITIES
from .audio import AudioConfig, AudioTower, encode_audio
from .cache import PassedLayerCache, make_cache
from .multimodal import MultimodalEmbedder
from .text import TextModel, materialize, softcap
from .vision import VisionConfig, VisionTower, encode_images


def check_token_ids(input_ids, vocab_size: int) -> None:
    """Raise :class:`TokenIdError` if any id is outside ``[0, vocab_size)`` (an MLX array is
    evaluated: a host sync; host arrays are checked on the host)."""
    ids = input_ids if isinstance(input_ids, mx.array) else np.asarray(input_ids)
    if ids.size == 0:
        raise ValueError("empty input: at least one token id is needed")
    lo, hi = int(ids.min()), int(ids.max())
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
        hidden = config.text_config.hidden_size
        if config.vision_config:
            vc = VisionConfig.from_dict(config.vision_config)
            self.vision_tower = VisionTower(vc)
            self.embed_vision = MultimodalEmbedder(vc.hidden_size, hidden, vc.rms_norm_eps)
        if config.audio_config:
            ac = AudioConfig.from_dict(config.audio_config)
            self.audio_tower = AudioTower(ac)
            self.embed_audio = MultimodalEmbedder(ac.output_proj_dims, hidden, ac.rms_norm_eps)
        # Multimodal placeholder ids; the text decoder sees the pad token there (as in HF), and the
        # multimodal model overwrites those embeddings with soft tokens.
        self._media_token_ids = (
            [i for i in (config.image_token_id, config.video_token_id, config.audio_token_id) if i is not None]
            if config.model_type in ("gemma4", "gemma4_unified")
            else []
        )

    @property
    def layers(self):
        """The decoder layers (under pipeline parallelism, None for those another process runs)."""
        return self.language_model.layers

    @property
    def stage(self):
        """This process's part of a pipeline (:mod:`gemma4_mlx.distributed.pipeline`), or None."""
        return self.language_model.stage

    @property
    def watchdog(self):
        """Under several processes, what stops this one when a forward pass waits too long, or None."""
        return self.language_model.watchdog

    @property
    def group(self):
        """The ``mx.distributed`` group sharing this model (:func:`~gemma4_mlx.distributed.load_sharded`), or None."""
        return getattr(self.language_model, "group", None)

    @property
    def traffic(self):
        """Under several processes, what this one exchanged with the others (a
        :class:`~gemma4_mlx.distributed.traffic.Traffic`), or None."""
        return getattr(self.language_model, "traffic", None)

    def use_pipeline(self, stage) -> None:
        """Keep only this process's part: its decoder layers, and on the first process the media
        encoders (the others receive the residual stream). Call before loading weights."""
        if not stage.is_first:
            for name in ("vision_tower", "audio_tower", "embed_vision", "embed_audio", "vision_embedder"):
                if name in self:
                    delattr(self, name)
        self.language_model.use_pipeline(stage)

    def merge_projections(self) -> None:
        """Projections that read the same input as one matmul each (q/k/v, gate/up; values
        unchanged, fewer kernels per step). Done by ``load_model``; parameter names change, so a
        merged model is for running, not for saving or loading weights into."""
        self.language_model.merge_projections()

    def materialize(self) -> None:
        """Evaluate every array the model holds (see :func:`~gemma4_mlx.models.text.materialize`)."""
        materialize(self)

    def make_cache(self, sliding_slack: int = 0, kv_bits: int | None = None, kv_group_size: int = 64, single_kv_storage: bool = True) -> list:
        """A fresh KV cache for incremental decoding (see :mod:`gemma4_mlx.models.cache`);
        ``sliding_slack`` more tokens in the sliding layers' ring buffers (speculative decoding);
        ``kv_bits`` (8 or 4) stores keys and values quantized, in groups of ``kv_group_size``.
        ``single_kv_storage``: the K=V layers (12B/26B/31B full attention) store their values alone and
        make their keys from them when read (half those layers' bytes; False stores both)."""
        layers = [l for l in self.layers if l is not None]
        derive = {l.spec.index: l.self_attn.keys_from_values for l in layers if l.spec.k_eq_v and not l.spec.is_kv_shared} if single_kv_storage else None
        cache = make_cache(self.text_config, sliding_slack, kv_bits, kv_group_size, derive)
        stage = self.stage
        if stage is not None:  # the layers other processes run only count tokens here
            cache = [c if stage.cached_here(i) else PassedLayerCache() for i, c in enumerate(cache)]
            if not stage.is_last:
                cache.append(PassedLayerCache())  # carries the send on (see PassedLayerCache)
        return cache

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

    @property
    def media_token_ids(self) -> list[int]:
        """The image, video and audio placeholder ids (empty for text-only checkpoints)."""
        return list(self._media_token_ids)

    @property
    def has_vision(self) -> bool:
        """Whether the model takes images and video (its config has a vision part)."""
        return bool(self.config.vision_config)

    @property
    def has_audio(self) -> bool:
        return bool(self.config.audio_config)

    def embed_multimodal(
        self,
        input_ids: mx.array,
        pixel_values=None,
        image_position_ids=None,
        pixel_values_videos=None,
        video_position_ids=None,
        input_features=None,
        input_features_mask=None,
    ) -> mx.array:
        """Text embeddings with the encoders' soft tokens scattered over the placeholder tokens.

        Run once per prompt; the result feeds ``model(input_ids, inputs_embeds=...)`` chunk by chunk.
        """
        input_ids = mx.array(input_ids)
        if input_ids.ndim == 1:
            input_ids = input_ids[None]
        text_ids = self.text_token_ids(input_ids)
        check_token_ids(text_ids, self.text_config.vocab_size)
        embeds = self.language_model.embed(text_ids)
        flat_ids = np.array(input_ids).reshape(-1)
        flat = embeds.reshape(-1, embeds.shape[-1])
        media = [
            ("image", self.config.image_token_id, pixel_values, lambda: self.encode_images(pixel_values, image_position_ids), self.has_vision),
            ("video", self.config.video_token_id, pixel_values_videos, lambda: self.encode_images(pixel_values_videos, video_position_ids), self.has_vision),
            ("audio", self.config.audio_token_id, input_features, lambda: self.encode_audio(input_features, input_features_mask), self.has_audio),
        ]
        # Under pipeline parallelism only the first process encodes media (the others' layers take
        # the residual stream from it); all check the prompt alike.
        encodes = self.stage is None or self.stage.is_first
        for kind, token_id, given, encode, supported in media:
            slots = np.flatnonzero(flat_ids == token_id) if token_id is not None else np.zeros(0, int)
            if given is None:
                if len(slots):
                    raise MediaError(f"the prompt has {len(slots)} {kind} placeholder tokens but no {kind} input")
                continue
            if not supported:
                raise MediaError(MODALITIES[kind].unsupported())
            if not encodes:
                continue
            features = encode()
            if features.shape[0] != len(slots):
                raise MediaError(
                    f"{kind} placeholders and {kind} soft tokens do not match: the prompt has {len(slots)}, "
                    f"the {kind} input gives {features.shape[0]}"
                )
            flat[mx.array(slots, dtype=mx.int32)] = features.astype(flat.dtype)
        return flat.reshape(embeds.shape)

    def encode_images(self, pixel_values, position_ids) -> mx.array:
        """Soft tokens of images or video frames, in order, padding dropped: [N, text hidden]."""
        return encode_images(self.vision_tower, self.embed_vision, pixel_values, position_ids)

    def encode_audio(self, input_features, input_features_mask) -> mx.array:
        """Soft tokens of audio clips, in order, padding dropped: [N, text hidden]."""
        return encode_audio(self.audio_tower, self.embed_audio, input_features, input_features_mask)

    def vision_block_ids(self, input_ids) -> np.ndarray | None:
        """For ``use_bidirectional_attention == "vision"``: an id per contiguous run of image/video
        soft tokens (-1 elsewhere), whose tokens see each other in sliding layers; None otherwise."""
        if self.text_config.use_bidirectional_attention != "vision":
            return None
        ids = np.array(input_ids)
        vision_ids = [i for i in (self.config.image_token_id, self.config.video_token_id) if i is not None]
        is_vision = np.isin(ids, vision_ids)
        if not is_vision.any():
            return None
        starts = is_vision & ~np.concatenate([np.zeros_like(is_vision[..., :1]), is_vision[..., :-1]], axis=-1)
        return np.where(is_vision, np.cumsum(starts, axis=-1) - 1, -1)

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
        **media,
    ) -> mx.array:
        """Logits for ``input_ids`` [B, L] (or precomputed ``inputs_embeds`` [B, L, hidden]).

        The entry point for calling the model directly: token ids of prompts (L > 1) are checked
        against the vocabulary and image blocks found on the host, then :meth:`forward` runs. Media
        inputs (``pixel_values``, ``image_position_ids``, ``pixel_values_videos``,
        ``video_position_ids``, ``input_features``, ``input_features_mask``, as the processor returns
        them) are encoded and merged into the embeddings.
        """
        media = {k: v for k, v in media.items() if v is not None and k not in ("num_soft_tokens",)}
        if input_ids is not None and not isinstance(input_ids, mx.array):
            input_ids = mx.array(input_ids)
        if input_ids is not None and input_ids.ndim == 1:
            input_ids = input_ids[None]
        if media:
            if input_ids is None:
                raise ValueError("media inputs need input_ids with their placeholder tokens")
            inputs_embeds = self.embed_multimodal(input_ids, **media)
        if input_ids is None and inputs_embeds is None:
            raise ValueError("pass input_ids or inputs_embeds")
        blocks = None
        if input_ids is not None and input_ids.shape[-1] > 1:  # prompts: decode steps never wait on the host
            check_token_ids(self.text_token_ids(input_ids), self.text_config.vocab_size)
            blocks = self.vision_block_ids(input_ids)
        return self.forward(input_ids, cache, inputs_embeds, per_layer_token_inputs, blocks)

    def forward(
        self,
        input_ids: mx.array | None,
        cache: list | None = None,
        inputs_embeds: mx.array | None = None,
        per_layer_token_inputs: mx.array | None = None,
        vision_blocks: np.ndarray | None = None,
        return_hidden: bool = False,
    ) -> mx.array | tuple[mx.array, mx.array]:
        """Logits [B, L, vocab] with no host sync: ids are not checked here (the request pipeline
        checks a prompt once), and ``vision_blocks`` ([B, L] image-block ids of this chunk, from
        :meth:`vision_block_ids`) come precomputed. With ``return_hidden``, ``(hidden, logits)``:
        the final normed hidden states too (what a drafter reads)."""
        if input_ids is not None:
            input_ids = self.text_token_ids(input_ids)
        h = self.language_model(input_ids, cache, inputs_embeds, per_layer_token_inputs, vision_blocks)
        return (h, self.logits(h)) if return_hidden else self.logits(h)
