"""The 12B unified (encoder-free) model's processors: transformers 5.23's ``Gemma4UnifiedImageProcessor``,
``Gemma4UnifiedVideoProcessor`` and ``Gemma4UnifiedAudioFeatureExtractor``.

What differs from Gemma 4's processors (:mod:`.image`, :mod:`.video`, :mod:`.audio`), because the
12B has no vision or audio tower to feed:

* images are sized as before (sides multiples of 48 px, ``9 * max_soft_tokens`` patches of 16 px),
  but resized with torchvision's antialiased bicubic on uint8, as video frames already are, not
  Pillow's; then every 3x3 group of 16 px patches is merged into one 48x48x3 = 6912-value patch, one
  soft token each (:func:`patches_merge`). ``pixel_values`` is [images, max_soft_tokens, 6912],
  positions are those of the 48 px grid;
* video frames get the same merge (frame sampling and time stamps are Gemma 4's);
* audio has no mel spectrogram: the raw 16 kHz waveform is cut into 40 ms frames of 640 samples,
  the last one zero padded, one soft token per frame (``ceil(samples / 640)``, no downsampling).

Why hand-written: transformers' unified image and video processors are torch/torchvision code, and
neither is a runtime dependency. The pieces are Gemma 4's (loading, sizing, the bit-exact torch
resize of :mod:`.resize`, frame sampling, audio decoding) plus the merge, tested equal to transformers.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ..errors import MediaError
from .audio import SAMPLING_RATE, AudioFeatureExtractor, load_audio
from .image import ImageProcessor, check_budget, load_image
from .video import VideoProcessor

AUDIO_SAMPLES_PER_TOKEN = 640  # 40 ms at 16 kHz
AUDIO_SEQ_LENGTH = 750  # soft tokens per clip at most: 30 s, as for E2B/E4B


def patches_merge(patches: np.ndarray, positions: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' ``patches_merge`` for unpadded patches: [..., L, p*p*3] with (x, y) positions
    [..., L, 2] -> ``length`` patches [..., length, k*k*p*p*3] of k x k neighbours (L = length * k*k),
    laid out (kernel row, pixel row, kernel column, pixel column, channel), and their positions,
    the minimum of the neighbours' ``position // k``. On a full grid this is cutting k*p px patches."""
    p = math.isqrt(patches.shape[-1] // 3)
    k = math.isqrt(patches.shape[-2] // length)
    if p * p * 3 != patches.shape[-1] or k * k * length != patches.shape[-2]:
        raise ValueError(f"cannot merge patches {patches.shape} into {length}")
    # Order the patches kernel by kernel (kernels row-major, then row-major inside each kernel).
    kernel, inside = positions // k, positions % k
    width = positions[..., :1].max(axis=-2) + 1  # patches per row, [..., 1]
    order = k * k * kernel[..., 0] + k * width * kernel[..., 1] + inside[..., 0] + inside[..., 1] * k
    perm = np.argsort(order, axis=-1, kind="stable")[..., None]
    lead = patches.shape[:-2]
    grouped = np.take_along_axis(patches, perm, axis=-2).reshape(*lead, length, k, k, p, p, 3)
    n = len(lead)
    merged = grouped.transpose(*range(n), n, n + 1, n + 3, n + 2, n + 4, n + 5).reshape(*lead, length, -1)
    merged_positions = (np.take_along_axis(positions, perm, axis=-2) // k).reshape(*lead, length, k * k, 2).min(axis=-2)
    return merged, merged_positions


class UnifiedVideoProcessor(VideoProcessor):
    """:class:`VideoProcessor` with merged patches: ``pixel_values_videos`` [frames, max_soft_tokens,
    6912] float32 (zero padded), ``video_position_ids`` [frames, max_soft_tokens, 2] int64 (padded with
    -1), ``num_soft_tokens`` and ``timestamps`` per video; transformers' ``Gemma4UnifiedVideoProcessor``."""

    def _patchify(self, frames: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray, int]:
        """RGB uint8 [T, H, W, 3] -> merged patches [T, budget, (k*p)^2*3], positions [T, budget, 2]
        and soft tokens per frame: Gemma 4's patches, then merged as transformers does (before padding)."""
        pixels, positions, n = super()._patchify(frames, budget)
        k = self.pooling_kernel_size
        grid = positions[0].max(axis=0) + 1  # patches per row and column
        if np.any(grid % k) or grid.prod() != n * k * k:
            raise MediaError(f"a grid of {grid[1]}x{grid[0]} patches of {self.patch_size} px does not merge into {k}x{k} groups")
        merged, merged_positions = patches_merge(pixels[:, : n * k * k], positions[:, : n * k * k], n)
        pixels = np.zeros((len(frames), budget, merged.shape[-1]), dtype=np.float32)
        pixels[:, :n] = merged
        positions = np.full((len(frames), budget, 2), -1, dtype=np.int64)
        positions[:, :n] = merged_positions
        return pixels, positions, n


class UnifiedImageProcessor(ImageProcessor):
    """``processor(images)`` -> ``pixel_values`` [images, max_soft_tokens, 6912] float32 (zero padded),
    ``image_position_ids`` [images, max_soft_tokens, 2] int64 (padded with -1) and ``num_soft_tokens``
    (list of int); transformers' ``Gemma4UnifiedImageProcessor``. Settings, sizes and loading are
    :class:`ImageProcessor`'s; the pixels are a one-frame video's (:class:`UnifiedVideoProcessor`),
    since transformers' unified image and video processors resize, rescale and merge alike."""

    def __init__(self, *args, **settings):
        super().__init__(*args, **settings)
        if self.resample != Image.Resampling.BICUBIC:
            raise ValueError(f"images are resized with bicubic resampling (3) only, got resample={int(self.resample)}")

    def _frames(self) -> UnifiedVideoProcessor:
        return UnifiedVideoProcessor(
            num_frames=1, max_soft_tokens=self.max_soft_tokens, patch_size=self.patch_size,
            pooling_kernel_size=self.pooling_kernel_size, do_resize=self.do_resize, do_rescale=self.do_rescale,
            rescale_factor=self.rescale_factor, do_normalize=self.do_normalize, image_mean=self.image_mean,
            image_std=self.image_std,
        )  # fmt: skip

    def __call__(self, images, max_soft_tokens: int | None = None) -> dict[str, Any]:
        """One image or a list (paths, PIL images, arrays; see :func:`~.image.load_image`)."""
        budget = check_budget(self.max_soft_tokens if max_soft_tokens is None else max_soft_tokens)
        single = isinstance(images, (str, Path, Image.Image)) or getattr(images, "ndim", 4) < 4
        frames = [load_image(source)[None] for source in ([images] if single else images)]
        if not frames:
            raise MediaError("no images given")
        out = self._frames()(frames, budget)
        table = self.position_table_size
        for i, positions in enumerate(out["video_position_ids"]):
            if table is not None and positions.max() >= table:
                h, w = frames[i].shape[1:3]
                raise MediaError(
                    f"image {i + 1} ({w}x{h} px) is too elongated for this model: it spans {positions.max() + 1} "
                    f"patches, the model has positions for {table}; crop it"
                )
        return {
            "pixel_values": out["pixel_values_videos"],
            "image_position_ids": out["video_position_ids"],
            "num_soft_tokens": out["num_soft_tokens"],
        }


class UnifiedAudioFeatureExtractor:
    """transformers' ``Gemma4UnifiedAudioFeatureExtractor``: ``extractor(audios)`` -> ``input_features``
    [clips, frames, 640] float32 (the waveform in 640-sample frames, zero padded), ``input_features_mask``
    [clips, frames] bool and ``num_soft_tokens`` (list of int: ``ceil(samples / 640)``, one per frame).

    Clips are cut at ``audio_seq_length`` frames (750: 30 s), as transformers cuts them when given
    ``max_length=audio_seq_length``. Its extractor has no limit by default, but its processor's
    ``audio_seq_length`` is documented as the cap per clip, and 30 s is the E2B/E4B extractors' limit.
    """

    def __init__(
        self,
        audio_samples_per_token: int = AUDIO_SAMPLES_PER_TOKEN,
        sampling_rate: int = SAMPLING_RATE,
        padding_value: float = 0.0,
        audio_seq_length: int = AUDIO_SEQ_LENGTH,
    ):
        if sampling_rate != SAMPLING_RATE:
            raise ValueError(f"the unified model takes {SAMPLING_RATE} Hz audio, got sampling_rate={sampling_rate}")
        self.audio_samples_per_token = int(audio_samples_per_token)
        self.padding_value = padding_value
        self.audio_seq_length = int(audio_seq_length)

    # The same settings files and keys as the mel extractor (the ``feature_extractor`` block of
    # processor_config.json, ``audio_seq_length`` beside it), keeping those this class takes.
    from_pretrained = classmethod(AudioFeatureExtractor.from_pretrained.__func__)

    def __call__(self, audios, sampling_rate: int | None = None) -> dict[str, Any]:
        """Frames for one clip or a list of clips (arrays or file paths; see :func:`~.audio.load_audio`);
        a 2-D array is a batch of clips, one per row. Empty clips raise :class:`MediaError`."""
        samples = isinstance(audios, (list, tuple)) and len(audios) and isinstance(audios[0], (int, float, np.number))
        one = isinstance(audios, (str, Path)) or getattr(audios, "ndim", None) == 1 or samples
        if not (one or len(audios)):
            raise MediaError("no audio clips given")
        size, limit = self.audio_samples_per_token, self.audio_seq_length
        seconds = limit * size / SAMPLING_RATE  # files are decoded no further than needed
        clips = [load_audio(a, sampling_rate, max_seconds=seconds)[: limit * size] for a in ([audios] if one else audios)]
        tokens = [-(-len(c) // size) for c in clips]
        features = np.full((len(clips), max(tokens), size), self.padding_value, dtype=np.float32)
        mask = np.zeros((len(clips), max(tokens)), dtype=bool)
        for i, (clip, n) in enumerate(zip(clips, tokens)):
            features[i, :n] = np.pad(clip, (0, n * size - len(clip))).reshape(n, size)  # the last frame zero padded
            mask[i, :n] = True
        return {"input_features": features, "input_features_mask": mask, "num_soft_tokens": tokens}


def unified_processors(folder: str | Path, config) -> tuple:
    """(image processor, audio extractor, video processor) of a ``gemma4_unified`` checkpoint folder,
    with the settings of its processor config; ``None`` for what its config has no embedder for."""
    from ..models.unified import UnifiedVisionConfig

    image = audio = video = None
    if config.vision_config:
        image = UnifiedImageProcessor.from_pretrained(folder)
        image.position_table_size = UnifiedVisionConfig.from_dict(config.vision_config).mm_posemb_size
        video = UnifiedVideoProcessor.from_pretrained(folder)
    if config.audio_config:
        audio = UnifiedAudioFeatureExtractor.from_pretrained(folder)
    return image, audio, video
