"""Video input: decode with PyAV, sample frames as transformers does, and time-stamp them.

Gemma 4 sees a video as up to 32 frames, each an image of 70 soft tokens, and the prompt gives each
frame its time stamp: ``"mm:ss <|image>" + 70 x <|video|> + "<image|>"``, frames joined by spaces.
Frames are then patchified by the image processor (``max_soft_tokens=70``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import MediaError

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
    frames = frames[..., :3]
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
