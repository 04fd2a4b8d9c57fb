"""Images in: load, resize to the soft-token budget, patchify. transformers' ``Gemma4ImageProcessorPil``.

An image is resized (aspect ratio kept, bicubic through Pillow) to the largest size whose sides are
multiples of 48 px and whose 16x16 patches fit ``9 * max_soft_tokens``; pixels go to [0, 1] and the
patches are listed row-major with (x=col, y=row) positions, zero padded to the budget with (-1, -1).

Why not call transformers' torch-free ``Gemma4ImageProcessorPil``: importing it imports transformers'
image utilities, which import torchvision whenever it is installed (and fail outright where that
torchvision does not match torch, see the README), it raises no error naming the input it could not
read, and it leaves EXIF orientation to the caller. The math here is a few lines, tested equal to it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from ..config import read_json_object
from ..errors import MediaError

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


def check_budget(max_soft_tokens: int) -> int:
    """An image token budget (per image or video frame), refused unless it is one of the published ones."""
    if max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
        raise ValueError(f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, got {max_soft_tokens!r}")
    return int(max_soft_tokens)


def _pil_to_rgb(image: Image.Image) -> np.ndarray:
    """Upright RGB uint8 [H, W, 3]; transparency composited onto white as transformers'
    ``convert_to_rgb`` does for PIL images."""
    image = ImageOps.exif_transpose(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image)
    return np.asarray(image.convert("RGB"))


def _array_to_rgb(array: np.ndarray) -> np.ndarray:
    """[H, W], [H, W, 1|3|4] uint8 (or float in [0, 1]) -> RGB uint8 [H, W, 3]."""
    if array.ndim == 2:
        array = array[..., None]
    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4) or 0 in array.shape:
        raise MediaError(f"an image array must be [height, width, channels] (1, 3 or 4 channels), got {array.shape}")
    if np.issubdtype(array.dtype, np.floating):
        if not (np.isfinite(array).all() and array.min() >= 0.0 and array.max() <= 1.0):
            raise MediaError("a float image array must hold values in [0, 1]")
        array = np.round(array * 255.0).astype(np.uint8)
    elif np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        if array.min() < 0 or array.max() > 255:
            raise MediaError(f"an integer image array must hold values in [0, 255], got [{array.min()}, {array.max()}]")
        array = array.astype(np.uint8)
    else:
        raise MediaError(f"unsupported image array dtype {array.dtype}")
    if array.shape[-1] == 1:
        return np.repeat(array, 3, axis=-1)
    if array.shape[-1] == 4:
        # transformers' convert_to_rgb for arrays: blend onto white in float64, round.
        alpha = array[..., 3:4] / 255
        return np.round(alpha * array[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return np.ascontiguousarray(array)


def load_image(source) -> np.ndarray:
    """An image as upright RGB uint8 [H, W, 3] from a file path, a PIL image or an array.

    EXIF orientation is applied (to PIL images too); transparency is composited onto white;
    grayscale, palette and CMYK images are converted to RGB. A float array must be in [0, 1] and is
    rounded to uint8 (transformers would rescale it twice). Unreadable files raise :class:`MediaError`.
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        if str(source).startswith(("http://", "https://")):
            raise MediaError(f"cannot read image {source}: URLs are not fetched, download the file first")
        if not path.exists():
            raise MediaError(f"cannot read image {path}: no such file")
        if not path.is_file():
            raise MediaError(f"cannot read image {path}: not a file")
        try:
            with Image.open(path) as image:
                image.load()  # decode now, so that a truncated file fails here
                return _pil_to_rgb(image)
        except _DECODE_ERRORS as e:
            raise MediaError(f"cannot read image {path}: {e}") from e
    if isinstance(source, Image.Image):
        try:
            return _pil_to_rgb(source)
        except _DECODE_ERRORS as e:
            raise MediaError(f"cannot decode image {source!r}: {e}") from e
    try:
        array = np.asarray(source)
    except Exception as e:  # noqa: BLE001 - anything numpy cannot take is not an image
        raise MediaError(f"not an image: {type(source).__name__}") from e
    if array.dtype == object:
        raise MediaError(f"not an image: {type(source).__name__}")
    return _array_to_rgb(array)


def aspect_ratio_preserving_size(
    height: int, width: int, patch_size: int, max_patches: int, pooling_kernel_size: int
) -> tuple[int, int]:
    """transformers' ``get_aspect_ratio_preserving_size``: the largest (h, w), sides multiples of
    ``pooling_kernel_size * patch_size``, with at most ``max_patches`` patches."""
    target_px = max_patches * patch_size**2
    factor = math.sqrt(target_px / (height * width))
    side = pooling_kernel_size * patch_size
    th = int(math.floor(factor * height / side)) * side
    tw = int(math.floor(factor * width / side)) * side
    if th == 0 and tw == 0:
        raise ValueError(f"cannot resize a {height}x{width} image to a 0x0 grid")
    max_side = (max_patches // pooling_kernel_size**2) * side
    # A very thin image: the thin side gets one pooling cell, the long one the aspect ratio (capped).
    if th == 0:
        th, tw = side, min(int(math.floor(width / height)) * side, max_side)
    elif tw == 0:
        th, tw = min(int(math.floor(height / width)) * side, max_side), side
    if th * tw > target_px:
        raise ValueError(f"resizing {height}x{width} to {th}x{tw} exceeds {max_patches} patches of {patch_size} px")
    return th, tw


class ImageProcessor:
    """``processor(images)`` -> ``{"pixel_values", "image_position_ids", "num_soft_tokens"}`` (numpy)."""

    def __init__(
        self,
        max_soft_tokens: int = 280,
        patch_size: int = 16,
        pooling_kernel_size: int = 3,
        do_resize: bool = True,
        resample: int = Image.Resampling.BICUBIC,
        do_rescale: bool = True,
        rescale_factor: float = 1 / 255,
        do_normalize: bool = False,
        image_mean: tuple[float, ...] = (0.0, 0.0, 0.0),
        image_std: tuple[float, ...] = (1.0, 1.0, 1.0),
    ):
        self.max_soft_tokens = check_budget(max_soft_tokens)
        self.patch_size = patch_size
        self.pooling_kernel_size = pooling_kernel_size
        self.do_resize = do_resize
        self.resample = Image.Resampling(int(resample))
        self.do_rescale = do_rescale
        self.rescale_factor = rescale_factor
        self.do_normalize = do_normalize
        self.image_mean = np.asarray(image_mean, dtype=np.float32)
        self.image_std = np.asarray(image_std, dtype=np.float32)
        # The vision tower's position table size (set by the Processor from the model's config): a
        # very elongated image can need more patch positions than the tower has.
        self.position_table_size: int | None = None

    load_image = staticmethod(load_image)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "ImageProcessor":
        """Settings from a checkpoint folder: the ``image_processor`` block of ``processor_config.json``,
        or a flat ``preprocessor_config.json``; defaults for whatever is absent."""
        settings: dict[str, Any] = {}
        for name in ("preprocessor_config.json", "processor_config.json"):  # the latter wins
            path = Path(folder) / name
            if not path.is_file():
                continue
            raw = read_json_object(path, "a processor config")
            block = raw.get("image_processor")
            if isinstance(block, dict):
                settings.update(block)
            elif "ImageProcessor" in str(raw.get("image_processor_type", "")) or "max_soft_tokens" in raw:
                settings.update(raw)
        known = ("max_soft_tokens", "patch_size", "pooling_kernel_size", "do_resize", "resample", "do_rescale",
                 "rescale_factor", "do_normalize", "image_mean", "image_std")  # fmt: skip
        return cls(**{k: settings[k] for k in known if settings.get(k) is not None})

    def target_size(self, height: int, width: int, max_soft_tokens: int | None = None) -> tuple[int, int]:
        """The (height, width) an image of this size is resized to."""
        if not self.do_resize:
            return height, width
        budget = check_budget(max_soft_tokens or self.max_soft_tokens)
        k = self.pooling_kernel_size
        return aspect_ratio_preserving_size(height, width, self.patch_size, budget * k * k, k)

    def num_soft_tokens(self, height: int, width: int, max_soft_tokens: int | None = None) -> int:
        """Soft tokens an image of this size becomes (what the prompt needs placeholders for)."""
        h, w = self.target_size(height, width, max_soft_tokens)
        return (h // self.patch_size) * (w // self.patch_size) // self.pooling_kernel_size**2

    def __call__(self, images, max_soft_tokens: int | None = None) -> dict[str, Any]:
        """One image or a list (paths, PIL images, arrays; see :func:`load_image`)."""
        budget = check_budget(self.max_soft_tokens if max_soft_tokens is None else max_soft_tokens)
        if isinstance(images, (str, Path, Image.Image)) or (isinstance(images, np.ndarray) and images.ndim <= 3):
            images = [images]
        images = list(images)
        if not images:
            raise MediaError("no images given")
        p, k = self.patch_size, self.pooling_kernel_size
        max_patches = budget * k * k
        pixel_values = np.zeros((len(images), max_patches, p * p * 3), dtype=np.float32)
        position_ids = np.full((len(images), max_patches, 2), -1, dtype=np.int64)
        num_soft_tokens = []
        for i, source in enumerate(images):
            image = load_image(source)
            patches, positions = self._patchify(image, budget)
            if len(patches) > max_patches:
                raise MediaError(f"image {i + 1} has {len(patches)} patches, more than the budget's {max_patches}")
            table = self.position_table_size
            if table is not None and len(positions) and positions.max() >= table:
                raise MediaError(
                    f"image {i + 1} ({image.shape[1]}x{image.shape[0]} px) is too elongated for this model: it "
                    f"spans {positions.max() + 1} patches, the vision tower has positions for {table}; crop it"
                )
            pixel_values[i, : len(patches)] = patches
            position_ids[i, : len(patches)] = positions
            num_soft_tokens.append(len(patches) // (k * k))
        return {"pixel_values": pixel_values, "image_position_ids": position_ids, "num_soft_tokens": num_soft_tokens}

    def _patchify(self, image: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
        """RGB uint8 [H, W, 3] -> patches [n, p*p*3] ((row, col, channel) inside) and (x, y) [n, 2]."""
        h, w = image.shape[:2]
        th, tw = self.target_size(h, w, budget)
        if (th, tw) != (h, w):
            # transformers' PIL backend: Image.resize((w, h), resample) on the uint8 image (Pillow
            # antialiases when downscaling), reducing_gap=None.
            image = np.asarray(Image.fromarray(image).resize((tw, th), resample=self.resample, reducing_gap=None))
        x = image.astype(np.float64) * self.rescale_factor if self.do_rescale else image.astype(np.float64)
        x = x.astype(np.float32)  # transformers rescales in float64, then casts
        if self.do_normalize:
            x = (x - self.image_mean) / self.image_std
        p = self.patch_size
        if th % p or tw % p:
            raise MediaError(f"a {th}x{tw} image does not split into {p}x{p} patches")
        gh, gw = th // p, tw // p
        patches = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, p * p * 3)
        gx, gy = np.meshgrid(np.arange(gw), np.arange(gh), indexing="xy")
        return patches, np.stack([gx, gy], axis=-1).reshape(-1, 2)
