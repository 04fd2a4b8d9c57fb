"""Video: the frame resize against torch's uint8 antialiased bicubic (what transformers' video processor
runs through torchvision), bit for bit."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from PIL import Image

from gemma4_mlx.resize import axis_weights, resize_bicubic_antialias


@functools.lru_cache(maxsize=None)
def noise_video(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Noise over a moving gradient, uint8 [T, H, W, 3]: resampling mistakes show in every frequency."""
    rng = np.random.default_rng(seed)
    t = np.arange(frames)[:, None, None, None]
    grad = np.linspace(0, 160, width)[None, None, :, None] + np.linspace(0, 60, height)[None, :, None, None] + 3 * t
    return np.clip(grad + rng.integers(0, 96, (frames, height, width, 3)), 0, 255).astype(np.uint8)


def torch_resize(images: np.ndarray, height: int, width: int) -> np.ndarray:
    x = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
    y = torch.nn.functional.interpolate(x, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    return y.permute(0, 2, 3, 1).numpy()


def pillow_resize(images: np.ndarray, height: int, width: int) -> np.ndarray:
    """What the video path did before (and the image path does): Pillow's antialiased bicubic."""
    return np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.BICUBIC, reducing_gap=None)) for f in images])


# ---------------------------------------------------------------------------------------------- resize
RESIZES = [
    (720, 1280, 288, 528),  # 720p to the 70-token size
    (48, 64, 384, 528),  # upscale
    (97, 131, 336, 432),  # odd sizes
    (17, 500, 48, 816),  # thin
    (600, 9, 816, 48),
    (1, 1, 48, 48),
    (2, 3, 384, 576),
    (5, 7, 5, 48),  # one axis only
    (64, 7, 48, 7),
    (1000, 1, 768, 48),  # a long downscale and an upscale of one pixel
    (300, 300, 299, 301),  # near identity
    (257, 1023, 1, 2),  # down to one row (torch asserts on 1x1 outputs with 3 channels)
]


@pytest.mark.parametrize("size", RESIZES, ids=lambda s: "{}x{}->{}x{}".format(*s))
def test_resize_matches_torch(size):
    H, W, h, w = size
    frames = noise_video(2, H, W)
    ours = resize_bicubic_antialias(frames, h, w)
    assert ours.dtype == np.uint8 and ours.shape == (2, h, w, 3)
    np.testing.assert_array_equal(ours, torch_resize(frames, h, w))


def test_resize_matches_torch_on_random_sizes():
    rng = np.random.default_rng(1)
    for _ in range(60):
        (H, W), (h, w) = rng.integers(1, 160, 2), rng.integers(1, 240, 2)
        frames = rng.integers(0, 256, (1, H, W, 3), dtype=np.uint8)
        np.testing.assert_array_equal(resize_bicubic_antialias(frames, h, w), torch_resize(frames, h, w), err_msg=f"{H}x{W}->{h}x{w}")


def test_resize_is_not_pillows():
    """The test above can fail: Pillow's bicubic (the image path) is one level off on some values."""
    frames = noise_video(4, 720, 1280)
    ref = torch_resize(frames, 288, 528)
    off = np.abs(pillow_resize(frames, 288, 528).astype(int) - ref)
    assert off.max() == 1 and 1e-4 < (off > 0).mean() < 1e-2
    # Weights with the precision torch picks (int16), not Pillow's 22 bits.
    _, _, w, precision = axis_weights(1280, 528)
    assert precision < 22 and np.abs(w).max() < 2**15


def test_resize_arguments():
    frames = noise_video(1, 10, 12)
    np.testing.assert_array_equal(resize_bicubic_antialias(frames[0], 10, 12), frames[0])  # [H, W, C], identity
    gray = resize_bicubic_antialias(frames[..., :1], 30, 20)
    np.testing.assert_array_equal(gray, torch_resize(frames[..., :1], 30, 20))
    with pytest.raises(ValueError, match="uint8"):
        resize_bicubic_antialias(frames.astype(np.float32), 5, 5)
    with pytest.raises(ValueError, match="cannot resize"):
        resize_bicubic_antialias(frames, 0, 5)
