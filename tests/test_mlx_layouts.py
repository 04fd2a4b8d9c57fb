"""Folders written by mlx-vlm's and mlx-lm's own converters (the mlx-community layouts) load and
match transformers (float) or the dequantized weights (quantized).

mlx-vlm writes ``language_model.model.*`` with bare ``vision_tower.*``/``audio_tower.*`` (audio conv
kernels already in MLX layout) and per-module overrides keyed by its own module names; mlx-lm
writes ``model.*`` (``gemma4_text``) or ``language_model.model.*`` without the towers (``gemma4``).
Both read the published config form (``global_head_dim``), so the sources here are saved that way.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import LARGE_VIT, SMALL_VIT, build_hf_model, dequantized_reference, save_checkpoint
from helpers import hf_logits, messages_with, random_image, rel_err, to_torch, tone

import gemma4_mlx

vlm_convert = pytest.importorskip("mlx_vlm.convert", reason="mlx-vlm is not installed").convert
from mlx_lm import convert as lm_convert  # noqa: E402

# output_proj_dims 64: a multiple of the group size, so mlx-vlm quantizes embed_audio too.
AUDIO_64 = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, subsampling_conv_channels=[128, 4],
             output_proj_dims=64)  # fmt: skip
IDS = mx.array([[2, 5, 6, 7, 300, 400, 500, 9, 10, 11, 12, 40, 41, 42, 43, 44, 45, 46, 47, 48]])


def save_published(hf, folder):
    """The published config form; the top-level ``vocab_size`` stays, because mlx-lm's ``gemma4``
    wrapper otherwise assumes the real 262144-token vocabulary."""
    save_checkpoint(hf, folder, form="published")
    config = json.loads((folder / "config.json").read_text())
    config.setdefault("vocab_size", config.get("text_config", config)["vocab_size"])
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def quantized_bits(model):
    return {name: m.bits for name, m in model.named_modules() if "scales" in m}


@pytest.fixture(scope="module")
def e2b_mm_published(tmp_path_factory):
    hf = build_hf_model("e2b", vision_config=SMALL_VIT, audio_config=AUDIO_64, hidden_size_per_layer_input=32)
    for sub in ("vision_config", "audio_config"):
        getattr(hf.config, sub)._attn_implementation = "eager"
    return hf, save_published(hf, tmp_path_factory.mktemp("e2b_mm_src"))


@pytest.fixture(scope="module")
def moe_mm_published(tmp_path_factory):
    hf = build_hf_model("moe26b", vision_config=LARGE_VIT)
    hf.config.vision_config._attn_implementation = "eager"
    return hf, save_published(hf, tmp_path_factory.mktemp("moe_mm_src"))


def mm_inputs(processor, audio=True):
    items = [{"type": "image", "image": random_image(120, 90, 0)}]
    if audio:
        items.append({"type": "audio", "audio": tone(0.6)})
    return processor.prepare(messages_with(*items), max_soft_tokens=70)


def test_mlx_vlm_float_multimodal_matches_hf(e2b_mm_published, tmp_path):
    hf, src = e2b_mm_published
    out = tmp_path / "vlm"
    vlm_convert(str(src), mlx_path=str(out), dtype="float32")
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert any(k.startswith("language_model.model.") for k in names) and "audio_tower.output_proj.weight" in names
    model, processor = gemma4_mlx.load(out)
    assert model.has_audio and model.language_model.mapped_ple is not None
    assert rel_err(model(IDS), hf_logits(hf, IDS)) < 1e-4
    # mlx-vlm's processor files give the same prompt and media arrays as the source's.
    inputs = mm_inputs(processor)
    _, own = gemma4_mlx.load(src)
    for k, v in mm_inputs(own).items():
        assert np.array_equal(np.array(inputs[k]), np.array(v)), k
    with torch.no_grad():
        ref = hf(**to_torch(inputs)).logits.numpy()
    assert rel_err(model(**inputs), ref) < 1e-4


def test_mlx_vlm_bfloat16_equals_loading_as_bfloat16(e2b_mm_published, tmp_path):
    _, src = e2b_mm_published
    out = tmp_path / "vlm_bf16"
    vlm_convert(str(src), mlx_path=str(out), dtype="bfloat16")
    model, _ = gemma4_mlx.load(out)
    direct, _ = gemma4_mlx.load(src, dtype="bfloat16")
    assert model.language_model.embed_tokens.weight.dtype == mx.bfloat16
    assert mx.array_equal(model(IDS), direct(IDS)).item()


@pytest.mark.parametrize("fixture", ["e2b_mm_published", "moe_mm_published"])
def test_mlx_vlm_4bit_matches_dequantized(fixture, request, tmp_path):
    hf, src = request.getfixturevalue(fixture)
    out = tmp_path / "vlm_q4"
    vlm_convert(str(src), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=64)
    cfg = json.loads((out / "config.json").read_text())["quantization"]
    model, processor = gemma4_mlx.load(out)
    bits = quantized_bits(model)
    assert bits["language_model.layers.0.self_attn.qkv_proj"] == 4
    assert not any(k.startswith(("vision_tower", "audio_tower")) for k in bits)  # mlx-vlm keeps towers float
    if fixture == "moe_mm_published":
        # mlx-vlm's 8-bit router override, keyed language_model.model.*, must reach our router.
        assert cfg["language_model.model.layers.0.router.proj"]["bits"] == 8
        assert bits["language_model.layers.0.router.proj"] == 8
    else:
        assert bits["embed_audio.embedding_projection"] == 4
        # mlx-vlm quantizes the PLE table to 4 bits as well (our converter keeps it at 8); it is
        # mapped lazily all the same, with bits and group size read from the shapes.
        mapped = model.language_model.mapped_ple
        assert mapped.quantized and (mapped.bits, mapped.group_size) == (4, 64)
    ref = dequantized_reference(out, src)
    assert rel_err(model(IDS), np.array(ref(IDS))) < 1e-4
    inputs = mm_inputs(processor, audio=model.has_audio)
    assert rel_err(model(**inputs), np.array(ref(**inputs))) < 1e-4
    # The quantized model is far from the float original (tiny random models are chaotic), but not absurdly.
    assert 0 < rel_err(model(IDS), hf_logits(hf, IDS)) < 1.5


@pytest.fixture(scope="module")
def e2b_text_published(tmp_path_factory):
    hf = build_hf_model("e2b", text_only=True, hidden_size_per_layer_input=32)
    return hf, save_published(hf, tmp_path_factory.mktemp("e2b_text_src"))


@pytest.mark.parametrize("quantize", [False, True])
def test_mlx_lm_gemma4_text(e2b_text_published, tmp_path, quantize):
    hf, src = e2b_text_published
    out = tmp_path / "lm"
    lm_convert(str(src), mlx_path=str(out), quantize=quantize, q_bits=4, q_group_size=64, dtype="float32")
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert "model.embed_tokens_per_layer.weight" in names
    model, _ = gemma4_mlx.load(out)
    if not quantize:
        assert rel_err(model(IDS), hf_logits(hf, IDS)) < 1e-4
        return
    assert quantized_bits(model)["language_model.layers.0.self_attn.qkv_proj"] == 4
    assert rel_err(model(IDS), np.array(dequantized_reference(out, src)(IDS))) < 1e-4


def test_mlx_lm_gemma4_drops_towers(moe_mm_published, tmp_path):
    """mlx-lm's ``gemma4`` keeps only the language model (and drops ``vision_config``): a text model."""
    _, src = moe_mm_published
    out = tmp_path / "lm_mm"
    lm_convert(str(src), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=64, dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["language_model.model.layers.0.router.proj"]["bits"] == 8
    model, _ = gemma4_mlx.load(out)
    assert "vision_tower" not in model and quantized_bits(model)["language_model.layers.0.router.proj"] == 8
    ref = dequantized_reference(out, src)
    assert rel_err(model(IDS), np.array(ref(IDS))) < 1e-4
