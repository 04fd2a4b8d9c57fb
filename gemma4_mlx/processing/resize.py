"""PyTorch's antialiased bicubic resize of uint8 images, bit for bit, in numpy (used for video frames).

transformers' ``Gemma4VideoProcessor`` resizes frames with torchvision: ``resize(frames, BICUBIC,
antialias=True)`` on uint8 tensors, which runs ATen's separable fixed-point kernel
(``_upsample_bicubic2d_aa``, aten/src/ATen/native/cpu/UpSampleKernel.cpp; the AVX2 kernel gives the
same integers). Its filter support and centring are Pillow's, but the cubic is evaluated in another
order and the weights are rounded to int16 at a per-axis precision (Pillow: 22 bits in int32), so
Pillow's bicubic is one level off on a fraction of a percent of the values. torch is not a runtime
dependency, hence this module. Per axis, in ATen's order of operations:

- ``scale = in / out``, ``support = 2 * max(scale, 1)``; output ``i`` reads the input pixels from
  ``xmin = trunc(scale * (i + 0.5) - support + 0.5)`` (at least 0, at most ``ceil(support) * 2 + 1``
  of them), weighted by Keys' cubic (a = -0.5) at ``(x - centre + 0.5) / max(scale, 1)``, normalised
  by their sequential sum;
- the weights become integers at the largest precision ``p`` (at most 22 bits) at which the axis's
  largest weight still fits in 15 bits, rounded half away from zero;
- each pass gives ``clamp((sum(pixel * weight) + 2**(p - 1)) >> p, 0, 255)``: the width first, then
  the height, each rounded to uint8.

Each pass is a banded matrix product (BLAS) on the colour planes, a block of outputs at a time so that
little but the band is multiplied, in floating point that holds the integer sums exactly (float32
where they stay below 2**24, float64 otherwise).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import lru_cache

import numpy as np

try:  # with librosa (scikit-learn) installed
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover
    threadpool_limits = None

_BLOCK = 16  # outputs per matrix block: few enough to skip most zeros, enough for BLAS


def _cubic(x: np.ndarray) -> np.ndarray:
    """ATen's ``HelperInterpCubic::aa_filter`` (Keys, a = -0.5), same operation order."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def axis_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """One axis of the resize: first input index [out], tap count [out], int16-valued weights
    [out, taps] (float64) and their precision in bits."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = math.ceil(support) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size) + 0.5)
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)  # astype truncates, as C++ casts do
    xsize = np.clip(np.minimum((center + support + 0.5).astype(np.int64), in_size) - xmin, 0, taps)
    j = np.arange(taps)
    w = _cubic(((j + xmin[:, None]) - center[:, None] + 0.5) * invscale)
    w = np.where(j < xsize[:, None], w, 0.0)
    total = np.zeros(out_size)
    for k in range(taps):  # summed in order: numpy's pairwise sum could differ in the last bit
        total += w[:, k]
    w = np.divide(w, total[:, None], out=w, where=total[:, None] != 0.0)
    wt_max = float(w.max(initial=0.0))
    precision = 0
    while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    v = w * (1 << precision)
    return xmin, xsize, np.trunc(np.where(v < 0, v - 0.5, v + 0.5)), precision


@lru_cache(maxsize=32)
def _plan(in_size: int, out_size: int) -> tuple[list, type]:
    """The axis's weights over ``2**precision`` (exact: a power of two) as dense blocks
    ``(o0, o1, i0, i1, weights[o1 - o0, i1 - i0])``, in the float type whose sums of pixels times
    weights are exact: float32 where the integer sums stay below 2**24, else float64 (below 2**53)."""
    xmin, xsize, w, precision = axis_weights(in_size, out_size)
    exact32 = 255 * np.abs(w).sum(axis=1).max() + (1 << (precision - 1)) < 1 << 24
    dtype = np.float32 if exact32 else np.float64
    blocks = []
    for o0 in range(0, out_size, _BLOCK):
        o1 = min(o0 + _BLOCK, out_size)
        i0, i1 = int(xmin[o0]), int((xmin + xsize)[o0:o1].max())
        dense = np.zeros((o1 - o0, i1 - i0))
        for o in range(o0, o1):
            dense[o - o0, xmin[o] - i0 : xmin[o] - i0 + xsize[o]] = w[o, : xsize[o]]
        blocks.append((o0, o1, i0, i1, (dense / (1 << precision)).astype(dtype)))
    return blocks, dtype


def _resample(planes: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One pass along the width (axis -1) or height (-2) of planes [C, H, W] holding uint8 values;
    the result, rounded and clamped as ATen's uint8 output, stays in floating point."""
    blocks, dtype = _plan(planes.shape[axis], out_size)
    x = planes.astype(dtype, order="C", copy=False)
    shape = list(x.shape)
    shape[axis] = out_size
    y = np.empty(shape, dtype)
    for o0, o1, i0, i1, block in blocks:
        if axis == -1:
            np.matmul(x[..., i0:i1], block.T, out=y[..., o0:o1])
        else:
            np.matmul(block, x[..., i0:i1, :], out=y[..., o0:o1, :])
    y += 0.5  # (sum + 2**(p - 1)) / 2**p, exactly
    np.floor(y, out=y)  # the arithmetic shift
    return np.clip(y, 0, 255, out=y)


def resize_bicubic_antialias(images: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize uint8 images [..., H, W, C] to [..., height, width, C] exactly as torch does
    (``interpolate(..., mode="bicubic", antialias=True)`` on uint8, which torchvision's ``resize`` calls)."""
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim < 3:
        raise ValueError(f"expected uint8 images [..., height, width, channels], got {images.dtype} {images.shape}")
    *lead, H, W, C = images.shape
    if min(H, W, C, height, width) < 1:
        raise ValueError(f"cannot resize {H}x{W}x{C} images to {height}x{width}")
    flat = images.reshape(-1, H, W, C)
    out = np.empty((len(flat), height, width, C), dtype=np.uint8)
    # These products are too small for BLAS threads to help; on a busy machine they only contend
    # (OpenBLAS: several times slower). One thread.
    with threadpool_limits(1, user_api="blas") if threadpool_limits else nullcontext():
        for i, frame in enumerate(flat):
            x = frame.transpose(2, 0, 1)  # [C, H, W]: each pass is a matrix product on one axis
            if width != W:  # the width first, then the height, as ATen does
                x = _resample(x, width, axis=-1)
            if height != H:
                x = _resample(x, height, axis=-2)
            out[i] = x.transpose(1, 2, 0)
    return out.reshape(*lead, height, width, C)
