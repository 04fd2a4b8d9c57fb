"""Vision: the image processor and the vision tower against transformers 5.23 (the numerical reference)."""

from __future__ import annotations

import functools
import io
import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Gemma4Config, Gemma4Model
from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from helpers import rel_err

from gemma4_mlx.processing.image import SUPPORTED_SOFT_TOKENS, ImageProcessor, load_image
from gemma4_mlx.errors import MediaError
from gemma4_mlx.models.multimodal import MultimodalEmbedder
from gemma4_mlx.models.vision import VisionConfig, VisionTower, encode_images

BUDGETS = (70, 140, 280, 560, 1120)


@functools.lru_cache(maxsize=None)
def noise_image(height: int, width: int, seed: int = 0) -> Image.Image:
    """Noise over a gradient: resampling mistakes show up in both high and low frequencies."""
    rng = np.random.default_rng(seed)
    grad = np.linspace(0, 160, width)[None, :, None] + np.linspace(0, 60, height)[:, None, None]
    pixels = np.clip(grad + rng.integers(0, 96, (height, width, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def hf_processor():
    return Gemma4ImageProcessorPil()


def assert_same_batch(ours: dict, ref) -> None:
    assert ours["pixel_values"].dtype == np.float32 and ours["pixel_values"].shape == tuple(ref["pixel_values"].shape)
    np.testing.assert_allclose(ours["pixel_values"], ref["pixel_values"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ours["image_position_ids"], ref["image_position_ids"])
    assert ours["num_soft_tokens"] == list(ref["num_soft_tokens_per_image"])


# ------------------------------------------------------------------------------------------ processor
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize(
    "size",
    [(5, 7), (480, 640), (1200, 500), (3000, 4000), (1, 900), (900, 1), (48, 48)],
    ids=lambda s: f"{s[0]}x{s[1]}",
)
def test_processor_matches_transformers(hf_processor, size, budget):
    image = noise_image(*size)
    ref = hf_processor(image, max_soft_tokens=budget)
    ours = ImageProcessor()(image, max_soft_tokens=budget)
    assert_same_batch(ours, ref)
    n = ours["num_soft_tokens"][0]
    assert 0 < n <= budget
    assert (ours["image_position_ids"][0] != -1).all(axis=-1).sum() == 9 * n


def test_processor_batch_of_mixed_images(hf_processor):
    images = [noise_image(480, 640), noise_image(5, 7, seed=1), noise_image(1, 900, seed=2), noise_image(1200, 500)]
    ref = hf_processor(images, max_soft_tokens=140)
    ours = ImageProcessor(max_soft_tokens=140)(images)
    assert_same_batch(ours, ref)


def _modes() -> dict[str, Image.Image]:
    base = noise_image(37, 50, seed=3)
    rgba = base.copy()
    alpha = np.tile(np.linspace(0, 255, 50).astype(np.uint8), (37, 1))
    rgba.putalpha(Image.fromarray(alpha))
    palette = base.quantize(colors=16)
    with_transparency = palette.copy()
    with_transparency.info["transparency"] = 3
    buf = io.BytesIO()
    with_transparency.save(buf, format="PNG")  # transparency as a PNG file carries it (tRNS chunk)
    return {
        "L": base.convert("L"),
        "LA": rgba.convert("LA"),
        "RGBA": rgba,
        "P": palette,
        "P+transparency": Image.open(io.BytesIO(buf.getvalue())),
        "CMYK": base.convert("CMYK"),
        "I;16": Image.fromarray((np.asarray(base.convert("L")).astype(np.uint16) * 3)),
    }


@pytest.mark.parametrize("mode", list(_modes()))
def test_processor_image_modes_match_transformers(hf_processor, mode):
    image = _modes()[mode]
    if mode == "P+transparency":
        assert image.info.get("transparency") is not None
    ref = hf_processor(image, max_soft_tokens=70)
    ours = ImageProcessor(max_soft_tokens=70)(image)
    assert_same_batch(ours, ref)
    if mode in ("RGBA", "LA"):
        # Fully transparent pixels (alpha 0 at column 0) come out white.
        assert (load_image(image)[:, 0] == 255).all()


def test_transparent_file_is_composited_onto_white(hf_processor, tmp_path):
    """A path is handled like the PIL image it holds. (transformers' own path loader calls
    ``convert("RGB")``, which drops alpha; its processor composites PIL images onto white.)"""
    path = tmp_path / "rgba.png"
    _modes()["RGBA"].save(path)
    with Image.open(path) as image:
        ref = hf_processor(image, max_soft_tokens=70)
    assert_same_batch(ImageProcessor()(path, max_soft_tokens=70), ref)


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_processor_arrays_match_transformers(hf_processor, channels):
    rng = np.random.default_rng(channels)
    array = rng.integers(0, 256, (37, 50, channels), dtype=np.uint8)
    assert_same_batch(ImageProcessor()(array, max_soft_tokens=70), hf_processor(array, max_soft_tokens=70))


def test_float_and_gray_arrays():
    rng = np.random.default_rng(7)
    array = rng.random((40, 30, 3))
    as_uint8 = np.round(array * 255).astype(np.uint8)
    np.testing.assert_array_equal(load_image(array), as_uint8)
    np.testing.assert_array_equal(load_image(array.astype(np.float32)), as_uint8)
    gray = rng.integers(0, 256, (40, 30), dtype=np.uint8)
    np.testing.assert_array_equal(load_image(gray), np.repeat(gray[..., None], 3, axis=-1))
    for bad in (array * 2, np.zeros((3, 40, 30), np.uint8), np.zeros((0, 5, 3), np.uint8), np.full((4, 4, 3), 300)):
        with pytest.raises(MediaError):
            load_image(bad)


def test_exif_orientation(hf_processor, tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    path = tmp_path / "rotated.jpg"
    noise_image(40, 96, seed=4).save(path, exif=exif, quality=95)
    assert load_image(path).shape == (96, 40, 3)
    # transformers' path loader applies EXIF orientation (load_image -> exif_transpose).
    ours = ImageProcessor()(str(path), max_soft_tokens=70)
    assert_same_batch(ours, hf_processor(str(path), max_soft_tokens=70))
    # The processed grid is portrait: taller than wide.
    pos = ours["image_position_ids"][0]
    pos = pos[(pos != -1).all(-1)]
    assert pos[:, 1].max() > pos[:, 0].max()
    # An opened PIL image is turned upright as well (transformers leaves that to the caller).
    with Image.open(path) as image:
        np.testing.assert_array_equal(load_image(image), load_image(path))


def test_gemma4_md_examples():
    proc = ImageProcessor()
    assert proc.target_size(480, 640) == (672, 912) and proc.num_soft_tokens(480, 640) == 266
    assert proc.target_size(480, 640, 70) == (336, 432) and proc.num_soft_tokens(480, 640, 70) == 63
    assert proc.target_size(1080, 1920) == (576, 1056) and proc.num_soft_tokens(1080, 1920) == 264
    out = proc([noise_image(480, 640), noise_image(1080, 1920)])
    assert out["num_soft_tokens"] == [266, 264]
    assert out["pixel_values"].shape == (2, 2520, 768) and out["image_position_ids"].shape == (2, 2520, 2)
    assert proc(noise_image(480, 640), max_soft_tokens=70)["num_soft_tokens"] == [63]


def test_budgets():
    from transformers.models.gemma4 import image_processing_pil_gemma4 as hf_images

    assert SUPPORTED_SOFT_TOKENS == hf_images._SUPPORTED_SOFT_TOKENS  # the budgets transformers accepts
    for bad in (0, 100, 300, 2240):
        with pytest.raises(ValueError, match="70, 140, 280, 560, 1120"):
            ImageProcessor(max_soft_tokens=bad)
        with pytest.raises(ValueError, match="max_soft_tokens"):
            ImageProcessor()(noise_image(20, 20), max_soft_tokens=bad)


def test_from_pretrained(tmp_path):
    assert ImageProcessor.from_pretrained(tmp_path).max_soft_tokens == 280  # no files: defaults
    flat = tmp_path / "flat"
    Gemma4ImageProcessorPil(max_soft_tokens=140).save_pretrained(str(flat))
    assert ImageProcessor.from_pretrained(flat).max_soft_tokens == 140
    nested = tmp_path / "nested"
    nested.mkdir()
    block = {"image_processor_type": "Gemma4ImageProcessor", "max_soft_tokens": 560, "patch_size": 16,
             "pooling_kernel_size": 3, "resample": 2, "rescale_factor": 0.00392156862745098}  # fmt: skip
    (nested / "processor_config.json").write_text(json.dumps({"image_processor": block, "image_seq_length": 280}))
    proc = ImageProcessor.from_pretrained(nested)
    assert proc.max_soft_tokens == 560 and proc.resample == Image.Resampling.BILINEAR
    hf = Gemma4ImageProcessorPil(max_soft_tokens=560, resample=2)
    assert_same_batch(proc(noise_image(300, 200)), hf(noise_image(300, 200)))


def test_unreadable_images(tmp_path):
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(MediaError, match="garbage.png") as err:
        load_image(garbage)
    assert "cannot identify" in str(err.value)
    with pytest.raises(MediaError, match=r"missing\.jpg.*no such file"):
        ImageProcessor()(str(tmp_path / "missing.jpg"))
    with pytest.raises(MediaError, match="not a file"):
        load_image(tmp_path)
    truncated = tmp_path / "truncated.png"
    buf = io.BytesIO()
    noise_image(64, 64).save(buf, format="PNG")
    truncated.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(MediaError, match="truncated.png"):
        ImageProcessor()([noise_image(10, 10), truncated])
    with pytest.raises(MediaError):
        ImageProcessor()([])


# ------------------------------------------------------------------------------------------ tower
FAMILIES = {
    # E2B/E4B-like: clipped linears, no standardize, default RoPE theta (100).
    "small": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, use_clipped_linears=True, standardize=False),
    # 26B/31B-like: standardize, no clipping; head_dim 12 (like 72, not a power of two), GQA, own theta.
    "large": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=12, use_clipped_linears=False, standardize=True,
                  rope_parameters={"rope_type": "axial", "rope_theta": 250.0}),
}  # fmt: skip
TEXT = dict(vocab_size=64, hidden_size=40, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, global_head_dim=16, layer_types=["full_attention"],
            hidden_size_per_layer_input=0)  # fmt: skip
# Different sizes give different real lengths (padding); the first and last share a resized size.
TOWER_IMAGES = [(60, 80), (200, 50), (30, 300), (61, 79)]


def build_hf(family: str, seed: int = 0) -> Gemma4Model:
    """A random fp32 Gemma4Model with a vision tower; norms, tables, clip bounds and standardize
    buffers are set to random non-trivial values (transformers initialises them to 1/0/inf)."""
    torch.manual_seed(seed)
    vision = Gemma4VisionConfig(position_embedding_size=128, **FAMILIES[family])
    model = Gemma4Model(Gemma4Config(text_config=TEXT, vision_config=vision.to_dict(), audio_config=None))
    g = torch.Generator().manual_seed(seed + 1)
    u = lambda t, lo, hi: torch.empty_like(t).uniform_(lo, hi, generator=g)  # noqa: E731
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not name.startswith(("vision_tower.", "embed_vision.")):
                continue
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(u(p, 0.4, 1.0))
            elif name.endswith("norm.weight"):
                p.copy_(u(p, 0.5, 1.5))
            elif name.endswith("weight"):  # linears: unit-scale outputs, so every layer matters
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            elif name.endswith("position_embedding_table"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith(("input_min", "output_min")):
                p.copy_(u(p, -1.5, -0.6))
            elif name.endswith(("input_max", "output_max")):
                p.copy_(u(p, 0.6, 1.5))
            elif name.endswith("std_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("std_scale"):
                p.copy_(u(p, 0.5, 1.5))
    model.eval()
    model.config._attn_implementation = "eager"
    model.config.vision_config._attn_implementation = "eager"
    return model


def load_ours(hf: Gemma4Model) -> tuple[VisionTower, MultimodalEmbedder]:
    state = {k: mx.array(v.numpy()) for k, v in hf.state_dict().items()}
    config = VisionConfig.from_dict(hf.config.vision_config.to_dict())
    tower = VisionTower(config)
    tower_weights = {k[len("vision_tower.") :]: v for k, v in state.items() if k.startswith("vision_tower.")}
    tower.load_weights(list(tower.sanitize(tower_weights).items()), strict=True)
    embedder = MultimodalEmbedder(config.hidden_size, hf.config.text_config.hidden_size, eps=config.rms_norm_eps)
    projection = state["embed_vision.embedding_projection.weight"]
    embedder.load_weights([("embedding_projection.weight", projection)], strict=True)
    return tower, embedder


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tower_case(request):
    hf = build_hf(request.param)
    images = [noise_image(h, w, seed=i) for i, (h, w) in enumerate(TOWER_IMAGES)]
    batch = Gemma4ImageProcessorPil()(images, max_soft_tokens=70)
    pv, pos = torch.from_numpy(batch["pixel_values"]), torch.from_numpy(batch["image_position_ids"])
    with torch.no_grad():
        ref_tower = hf.vision_tower(pixel_values=pv, pixel_position_ids=pos).last_hidden_state
        ref = torch.cat(hf.get_image_features(pv, pos).pooler_output)
    return request.param, hf, batch, ref_tower, ref


def test_tower_matches_transformers(tower_case):
    family, hf, batch, ref_tower, ref = tower_case
    lengths = (batch["image_position_ids"] != -1).all(-1).sum(-1)
    assert len(set(lengths.tolist())) == 3 and (lengths < 630).all()  # padding of several lengths
    tower, embedder = load_ours(hf)

    # The padded batch as transformers runs it (padding mask in attention).
    err_tower = rel_err(tower(batch["pixel_values"], batch["image_position_ids"]), ref_tower)
    # encode_images: each image on its own patches, then the embedder.
    out = encode_images(tower, embedder, batch["pixel_values"], batch["image_position_ids"])
    err = rel_err(out, ref)
    print(f"\n[{family}] tower rel err {err_tower:.2e}, encode_images rel err {err:.2e}")
    assert out.shape == (sum(batch["num_soft_tokens_per_image"]), TEXT["hidden_size"])
    assert err_tower < 1e-4 and err < 1e-4


def test_tower_is_sensitive(tower_case):
    """The comparison can fail: the random clip bounds / standardize buffers / padding mask matter."""
    family, hf, batch, ref_tower, _ = tower_case
    tower, _ = load_ours(hf)
    pv, pos = batch["pixel_values"], batch["image_position_ids"]
    if family == "small":
        inf = {k: mx.array(np.sign(np.array(v)) * np.inf) for k, v in _clip_bounds(tower).items()}
        tower.load_weights(list(inf.items()), strict=False)
    else:
        tower.std_scale = mx.ones_like(tower.std_scale)
    assert rel_err(tower(pv, pos), ref_tower) > 1e-2
    # Without the padding mask (positions of padding patches made "real"), the result moves too.
    tower, _ = load_ours(hf)
    unmasked = np.where(pos == -1, 0, pos)
    n0 = int(batch["num_soft_tokens_per_image"][0])
    assert rel_err(tower(pv[:1], unmasked[:1])[1:n0], ref_tower[1:n0]) > 1e-2  # cell 0 aside


def _clip_bounds(tower: VisionTower) -> dict[str, mx.array]:
    from mlx.utils import tree_flatten

    return {k: v for k, v in tree_flatten(tower.parameters()) if k.endswith(("_min", "_max"))}


def test_tower_bfloat16(tower_case):
    family, hf, batch, _, ref = tower_case
    tower, embedder = load_ours(hf)
    tower.set_dtype(mx.bfloat16)
    embedder.set_dtype(mx.bfloat16)
    out = encode_images(tower, embedder, batch["pixel_values"], batch["image_position_ids"])
    assert out.dtype == mx.bfloat16
    assert rel_err(out, ref) < 5e-2


def test_sanitize_and_config():
    config = VisionConfig.from_dict({**FAMILIES["large"], "model_type": "gemma4_vision", "something_new": 1})
    assert config.extra == {"model_type": "gemma4_vision", "something_new": 1}
    assert config.rope_theta == 250.0 and VisionConfig().rope_theta == 100.0
    # Names relative to the tower (the loader strips "model.vision_tower." once).
    weights = {
        "encoder.layers.0.self_attn.q_proj.linear.weight": 1,
        "encoder.layers.0.self_attn.q_proj.input_min": 2,
        "encoder.rotary_emb.inv_freq": 3,
        "std_bias": 4,
    }
    clipped = VisionTower(VisionConfig.from_dict({**FAMILIES["small"], "use_clipped_linears": True}))
    assert clipped.sanitize(weights) == {
        "encoder.layers.0.self_attn.q_proj.linear.weight": 1,
        "encoder.layers.0.self_attn.q_proj.input_min": 2,
        "std_bias": 4,
    }
    assert "encoder.layers.0.self_attn.q_proj.input_min" not in VisionTower(config).sanitize(weights)
