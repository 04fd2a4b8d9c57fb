"""Video input: decode with PyAV, sample and time-stamp frames, then resize and patchify them exactly
as transformers' ``Gemma4VideoProcessor`` does.

Gemma 4 sees a video as up to 32 frames, each an image of 70 soft tokens, and the prompt gives each
frame its time stamp: ``"mm:ss <|image>" + 70 x <|video|> + "<image|>"``, frames joined by spaces.
Frames are sized and patchified like images, but transformers resizes them with torchvision (PyTorch's
antialiased bicubic on uint8, reproduced in :mod:`.resize`) where images go through Pillow, and
rescales them in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import read_json_object
from ..errors import MediaError
from .image import aspect_ratio_preserving_size, check_budget
from .resize import resize_bicubic_antialias

NUM_FRAMES = 32
VIDEO_SOFT_TOKENS = 70  # image token budget per frame
DEFAULT_FPS = 24.0  # transformers' fallback when a video's frame rate is unknown


@dataclass
class Video:
    """Sampled RGB frames [T, H, W, 3] (uint8) with their time stamps in seconds."""

    frames: np.ndarray
    timestamps: list[float]

    def timestamp_labels(self) -> list[str]:
        return [f"{int(t // 60):02d}:{int(t % 60):02d}" for t in self.timestamps]


def sample_indices(total_frames: int, num_frames: int = NUM_FRAMES) -> np.ndarray:
    """transformers' uniform sampling, ``arange(n) * total // n``; short videos keep every frame
    (transformers raises there instead)."""
    n = min(num_frames, total_frames)
    return np.arange(n, dtype=int) * total_frames // n


def load_video(source, num_frames: int = NUM_FRAMES, fps: float | None = None) -> Video:
    """Decode and sample a video from a file path (any format FFmpeg reads, through PyAV), or take
    an array of frames [T, H, W, 3] (uint8, or float in [0, 1]) at ``fps`` frames per second."""
    if isinstance(source, Video):
        return source
    if isinstance(source, (str, Path)):
        return _decode_file(Path(source), num_frames)
    frames = np.asarray(source)
    if frames.ndim != 4 or frames.shape[-1] not in (1, 3, 4) or frames.shape[0] == 0:
        raise MediaError(f"a video array must be [frames, height, width, channels], got shape {frames.shape}")
    if frames.dtype != np.uint8:
        frames = (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)
    if frames.shape[-1] == 1:
        frames = np.repeat(frames, 3, axis=-1)
    elif frames.shape[-1] == 4:  # transparency onto white, as for images (opaque frames keep their RGB)
        alpha = frames[..., 3:] / 255
        frames = np.round(alpha * frames[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    idx = sample_indices(len(frames), num_frames)
    rate = fps or DEFAULT_FPS
    return Video(frames[idx], [float(i) / rate for i in idx])


def _decode_file(path: Path, num_frames: int) -> Video:
    import av

    if not path.is_file():
        raise MediaError(f"video file not found: {path}")
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError(f"{path} has no video stream")
            stream = container.streams.video[0]
            rate = float(stream.average_rate) if stream.average_rate else DEFAULT_FPS
            total = stream.frames
            if not total:  # some containers do not store the frame count: count by decoding
                total = sum(1 for _ in container.decode(stream))
                container.seek(0)
            if total == 0:
                raise MediaError(f"{path} has no decodable frames")
            wanted = sample_indices(total, num_frames)
            keep = set(wanted.tolist())
            frames = {}
            for i, frame in enumerate(container.decode(stream)):
                if i in keep:
                    frames[i] = frame.to_ndarray(format="rgb24")
                if i >= wanted[-1]:
                    break
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError) as e:
        raise MediaError(f"cannot decode video {path}: {e}") from None
    idx = [i for i in wanted.tolist() if i in frames]
    if not idx:
        raise MediaError(f"{path} has no decodable frames")
    return Video(np.stack([frames[i] for i in idx]), [i / rate for i in idx])


class VideoProcessor:
    """``processor(videos)`` -> ``{"pixel_values_videos", "video_position_ids", "num_soft_tokens",
    "timestamps"}`` (numpy, frames of all videos concatenated); transformers' ``Gemma4VideoProcessor``."""

    def __init__(
        self,
        num_frames: int = NUM_FRAMES,
        max_soft_tokens: int = VIDEO_SOFT_TOKENS,
        patch_size: int = 16,
        pooling_kernel_size: int = 3,
        do_resize: bool = True,
        resample: int = 3,
        do_rescale: bool = True,
        rescale_factor: float = 1 / 255,
        do_normalize: bool = True,
        image_mean: tuple[float, ...] = (0.0, 0.0, 0.0),
        image_std: tuple[float, ...] = (1.0, 1.0, 1.0),
    ):
        if int(resample) != 3:
            raise ValueError(f"video frames are resized with bicubic resampling (3) only, got resample={resample!r}")
        self.num_frames = int(num_frames)
        self.max_soft_tokens = check_budget(max_soft_tokens)
        self.patch_size = patch_size
        self.pooling_kernel_size = pooling_kernel_size
        self.do_resize = do_resize
        self.do_rescale = do_rescale
        self.rescale_factor = rescale_factor
        self.do_normalize = do_normalize
        self.image_mean = np.asarray(image_mean, dtype=np.float32)
        self.image_std = np.asarray(image_std, dtype=np.float32)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "VideoProcessor":
        """Settings from a checkpoint folder: the ``video_processor`` block of ``processor_config.json``,
        else ``video_preprocessor_config.json``; defaults for whatever is absent."""
        settings: dict[str, Any] = {}
        nested, flat = Path(folder) / "processor_config.json", Path(folder) / "video_preprocessor_config.json"
        if nested.is_file():
            settings = read_json_object(nested, "a processor config").get("video_processor") or {}
        if not settings and flat.is_file():
            settings = read_json_object(flat, "a video processor config")
        known = ("num_frames", "max_soft_tokens", "patch_size", "pooling_kernel_size", "do_resize", "resample",
                 "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")  # fmt: skip
        return cls(**{k: settings[k] for k in known if settings.get(k) is not None})

    def __call__(self, videos, max_soft_tokens: int | None = None) -> dict[str, Any]:
        """One video or a list (paths, :class:`Video`, frame arrays [T, H, W, C]; see :func:`load_video`).
        ``num_soft_tokens`` (per frame) and ``timestamps`` (``mm:ss`` per frame) have one entry per video."""
        if isinstance(videos, (str, Path, Video)) or (isinstance(videos, np.ndarray) and videos.ndim == 4):
            videos = [videos]
        videos = list(videos)
        if not videos:
            raise MediaError("no videos given")
        budget = check_budget(self.max_soft_tokens if max_soft_tokens is None else max_soft_tokens)
        keys = ("pixel_values_videos", "video_position_ids", "num_soft_tokens", "timestamps")
        out: dict[str, list] = {k: [] for k in keys}
        for source in videos:
            clip = load_video(source, self.num_frames)
            pixels, positions, soft_tokens = self._patchify(clip.frames, budget)
            out["pixel_values_videos"].append(pixels)
            out["video_position_ids"].append(positions)
            out["num_soft_tokens"].append(soft_tokens)
            out["timestamps"].append(clip.timestamp_labels())
        out["pixel_values_videos"] = np.concatenate(out["pixel_values_videos"])
        out["video_position_ids"] = np.concatenate(out["video_position_ids"])
        return out

    def _patchify(self, frames: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray, int]:
        """RGB uint8 [T, H, W, 3] -> patches [T, max_patches, p*p*3] (zero padded), (x, y) positions
        [T, max_patches, 2] (padded with -1) and soft tokens per frame."""
        p, k = self.patch_size, self.pooling_kernel_size
        max_patches = budget * k * k
        t, h, w = frames.shape[:3]
        if self.do_resize:
            th, tw = aspect_ratio_preserving_size(h, w, p, max_patches, k)
            if (th, tw) != (h, w):
                frames = resize_bicubic_antialias(frames, th, tw)
                h, w = th, tw
        gh, gw = h // p, w // p
        if h % p or w % p or gh * gw > max_patches:
            raise MediaError(f"{h}x{w} video frames do not split into at most {max_patches} patches of {p}x{p}")
        x = self._rescale_and_normalize(frames)
        pixels = np.zeros((t, max_patches, p * p * 3), dtype=np.float32)
        pixels[:, : gh * gw] = x.reshape(t, gh, p, gw, p, 3).transpose(0, 1, 3, 2, 4, 5).reshape(t, gh * gw, -1)
        positions = np.full((t, max_patches, 2), -1, dtype=np.int64)
        gx, gy = np.meshgrid(np.arange(gw), np.arange(gh), indexing="xy")
        positions[:, : gh * gw] = np.stack([gx, gy], axis=-1).reshape(-1, 2)
        return pixels, positions, gh * gw // k**2

    def _rescale_and_normalize(self, frames: np.ndarray) -> np.ndarray:
        """transformers' fused rescale and normalize, in float32 as torch computes it (the image path
        rescales in float64; for the default settings both give the same values)."""
        x = frames.astype(np.float32)
        if self.do_normalize:
            mean, std = self.image_mean, self.image_std
            if self.do_rescale:  # fused: mean and std scaled by 1 / rescale_factor, then one division
                mean, std = mean * np.float32(1 / self.rescale_factor), std * np.float32(1 / self.rescale_factor)
            return (x - mean) / std
        return x * np.float32(self.rescale_factor) if self.do_rescale else x
