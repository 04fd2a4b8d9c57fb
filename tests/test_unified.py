"""Gemma 4 12B, the unified (encoder-free) model, against transformers 5.23 (fp32, tiny random
checkpoints): media embedders, multimodal logits, cached decoding after a multimodal prompt, its
drafter, and configs. Text-only parity runs in the ``family`` tests (the ``unified`` family)."""

import copy
import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import build_hf_assistant, build_hf_unified, save_checkpoint, to_published_form
from helpers import rel_err
from mlx_lm.sample_utils import make_sampler

import gemma4_mlx
from gemma4_mlx.config import ModelConfig
from gemma4_mlx.errors import ConfigError, MediaError
from gemma4_mlx.generation.decode import generate_tokens
from gemma4_mlx.generation.speculative import SpeculativeStats, speculative_tokens
from gemma4_mlx.loading.assistant import load_drafter
from gemma4_mlx.testing import media_token_ids

IDS = media_token_ids()
IMAGE, AUDIO, VIDEO = IDS["image_token_id"], IDS["audio_token_id"], IDS["video_token_id"]
BOI, EOI, BOA, EOA = IDS["boi_token_id"], IDS["eoi_token_id"], IDS["boa_token_id"], IDS["eoa_token_index"]


class Unified:
    def __init__(self, folder, **overrides):
        self.hf = build_hf_unified(**overrides)
        self.path = save_checkpoint(self.hf, folder)
        self.model, self.processor = gemma4_mlx.load(self.path)


@pytest.fixture(scope="module")
def unified(tmp_path_factory):
    return Unified(tmp_path_factory.mktemp("unified"))


def patches(counts_and_widths, budget, seed):
    """Random merged patches [n, budget, 6912] with row-major (x, y) positions, padded with (-1, -1)."""
    rng = np.random.default_rng(seed)
    pv = np.zeros((len(counts_and_widths), budget, 6912), np.float32)
    pos = np.full((len(counts_and_widths), budget, 2), -1, np.int64)
    for i, (n, w) in enumerate(counts_and_widths):
        pv[i, :n] = rng.random((n, 6912))
        pos[i, :n] = np.stack([np.arange(n) % w, np.arange(n) // w], -1)
    return pv, pos


def waveforms(lengths, seed):
    """Random 640-sample frames [n, max, 640] and their mask."""
    rng = np.random.default_rng(seed)
    frames = np.zeros((len(lengths), max(lengths), 640), np.float32)
    mask = np.zeros((len(lengths), max(lengths)), bool)
    for i, n in enumerate(lengths):
        frames[i, :n] = rng.standard_normal((n, 640)) * 0.1
        mask[i, :n] = True
    return frames, mask


def block(begin, token, n, end):
    return [begin] + [token] * n + [end]


def multimodal_prompt():
    """Two images (one longer than the sliding window of 8), a video of two frames, two clips."""
    pv, pos = patches([(4, 2), (12, 4)], 16, seed=1)
    vpv, vpos = patches([(6, 3), (6, 3)], 16, seed=2)
    frames, mask = waveforms([5, 3], seed=3)
    ids = ([2, 5, 6] + block(BOI, IMAGE, 4, EOI) + [7] + block(BOI, IMAGE, 12, EOI) + [8, 9]
           + block(BOA, AUDIO, 5, EOA) + [10] + block(BOI, VIDEO, 6, EOI) + [11] + block(BOI, VIDEO, 6, EOI)
           + block(BOA, AUDIO, 3, EOA) + [12, 13])  # fmt: skip
    media = dict(pixel_values=pv, image_position_ids=pos, pixel_values_videos=vpv, video_position_ids=vpos,
                 input_features=frames, input_features_mask=mask)  # fmt: skip
    return ids, media


def hf_forward(hf, ids, media, past=None, **kwargs):
    ids = torch.tensor([ids])
    types = torch.zeros_like(ids)
    types[ids == IMAGE], types[ids == VIDEO], types[ids == AUDIO] = 1, 2, 3
    inputs = {k: torch.from_numpy(v) for k, v in media.items()}
    if "pixel_values_videos" in inputs:
        inputs["num_frames_per_video"] = torch.tensor([2])
    with torch.no_grad():
        return hf(input_ids=ids, mm_token_type_ids=types, past_key_values=past, **inputs, **kwargs)


def test_embedders_match_transformers(unified):
    pv, pos = patches([(5, 5), (9, 3)], 16, seed=4)
    frames, mask = waveforms([4, 2], seed=5)
    with torch.no_grad():
        ref_img = torch.cat(unified.hf.model.get_image_features(torch.from_numpy(pv), torch.from_numpy(pos), return_dict=True).pooler_output)
        ref_audio = unified.hf.model.get_audio_features(torch.from_numpy(frames), torch.from_numpy(mask), return_dict=True).pooler_output
    assert rel_err(unified.model.encode_images(pv, pos), ref_img.numpy()) < 1e-5
    assert rel_err(unified.model.encode_audio(frames, mask), ref_audio[torch.from_numpy(mask)].numpy()) < 1e-5


def test_flat_and_near_flat_patches_match_transformers(unified):
    """Patches of a white page, a grey, a sky and 8-bit levels: LayerNorm over 6912 near-equal values
    with eps 1e-5 magnifies any error in their mean (without centring first, MLX was 4e-3 off here)."""
    rng = np.random.default_rng(6)
    n = 6
    pv = np.zeros((1, 8, 6912), np.float32)
    pv[0, 0] = 1.0  # white
    pv[0, 1] = 2 * 0.3137255 - 1  # one grey level, normalized as the processor does
    pv[0, 2] = 0.5 + rng.normal(0, 1e-3, 6912)  # a sky with sensor noise
    pv[0, 3] = np.round((0.4 + rng.normal(0, 0.002, 6912)) * 255) / 255 * 2 - 1  # 8-bit levels around one value
    pv[0, 4] = np.linspace(-0.2, 0.6, 6912) + rng.normal(0, 0.01, 6912)  # a gradient
    pv[0, 5] = rng.random(6912)
    pos = np.full((1, 8, 2), -1, np.int64)
    pos[0, :n] = np.stack([np.arange(n) % 3, np.arange(n) // 3], -1)
    # Against transformers in float64: its float32 run is itself 2e-5 off on the sky patch.
    hf64 = copy.deepcopy(unified.hf.model).double()
    with torch.no_grad():
        ref = hf64.get_image_features(torch.from_numpy(pv).double(), torch.from_numpy(pos), return_dict=True).pooler_output[0]
    ours = np.array(unified.model.encode_images(pv, pos))
    for i in range(n):
        assert rel_err(ours[i], ref[i].numpy()) < 1e-5, i


def test_multimodal_logits_match_transformers(unified):
    """Images, video and audio in one prompt; image blocks see each other in every layer, past the
    sliding window (12 image tokens, a window of 8), which a causal mask would not reproduce."""
    ids, media = multimodal_prompt()
    ref = hf_forward(unified.hf, ids, media).logits.numpy()
    with torch.no_grad():
        causal = unified.hf(input_ids=torch.tensor([ids]), **{k: torch.from_numpy(v) for k, v in media.items()},
                            num_frames_per_video=torch.tensor([2])).logits.numpy()  # fmt: skip
    assert rel_err(causal, ref) > 1e-3  # the bidirectional blocks really change the result
    assert rel_err(unified.model(mx.array(ids), **media), ref) < 1e-4


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_cached_decoding_after_a_multimodal_prompt_matches_transformers(unified, kv_bits):
    """The prompt through our request pipeline (chunked, blocks kept whole), then token-by-token
    decoding past the windows; transformers' logits for the whole sequence at once as reference."""
    from gemma4_mlx.generation.decode import prefill

    ids, media = multimodal_prompt()
    cont = [int(t) for t in np.random.default_rng(6).integers(3, 700, 20)]
    ref = hf_forward(unified.hf, ids + cont, media).logits.numpy()[0, len(ids) - 1 : -1]
    model = unified.model
    cache = model.make_cache(kv_bits=kv_bits, kv_group_size=32)
    embeds = model.embed_multimodal(mx.array(ids), **media)[0]
    blocks = model.vision_block_ids(np.array(ids))
    prompt = len(ids) - 1  # the prompt's last token is decoded like the continuation
    assert prefill(model, mx.array(ids[:prompt]), cache, step_size=10, inputs_embeds=embeds[:prompt], vision_blocks=blocks[:prompt]) == prompt
    out = [np.array(model(mx.array([[t]]), cache=cache))[0] for t in ids[prompt:] + cont[:-1]]
    out = np.concatenate(out)
    tolerance = 1e-4 if kv_bits is None else 5e-2
    assert rel_err(out, ref) < tolerance


def test_published_and_transformers_config_forms_agree(unified, tmp_path):
    raw = json.loads((unified.path / "config.json").read_text())
    assert raw["text_config"]["model_type"] == "gemma4_unified_text" and "hidden_size_per_layer_input" not in raw["text_config"]
    config = ModelConfig.from_dict(raw)
    assert config.is_unified and not config.text_config.has_per_layer_inputs
    assert config.text_config.use_bidirectional_attention == "vision"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    to_published_form(tmp_path / "config.json")
    published = ModelConfig.from_file(tmp_path / "config.json")
    assert "per_layer_config" not in json.loads((tmp_path / "config.json").read_text())["text_config"]
    assert published.text_config.layers == config.text_config.layers
    assert [(s.head_dim, s.num_kv_heads, s.k_eq_v) for s in config.text_config.layers if not s.is_sliding] == [(64, 1, True)] * 2


def test_unified_configs_refuse_per_layer_embeddings_and_moe(unified):
    raw = json.loads((unified.path / "config.json").read_text())
    for field in ("hidden_size_per_layer_input", "enable_moe_block"):
        bad = dict(raw, text_config={**raw["text_config"], field: 256 if field.startswith("hidden") else True})
        with pytest.raises(ConfigError, match=field):
            ModelConfig.from_dict(bad)
    bad = dict(raw, vision_config={**raw["vision_config"], "output_proj_dims": 7})
    with pytest.raises(ConfigError, match="output_proj_dims"):
        gemma4_mlx.models.build_model(ModelConfig.from_dict(bad))


def test_patch_positions_outside_the_table_are_refused(unified):
    pv, pos = patches([(4, 2)], 8, seed=7)
    pos[0, 0] = (500, 0)  # the tiny table has 128 rows
    with pytest.raises(MediaError, match="position embeddings"):
        unified.model.encode_images(pv, pos)


def test_text_only_unified_checkpoints_load(unified, tmp_path):
    """A ``gemma4_unified_text`` checkpoint (the decoder alone) gives the full model's text logits."""
    raw = json.loads((unified.path / "config.json").read_text())
    text = dict(raw["text_config"])
    (tmp_path / "config.json").write_text(json.dumps(text))
    weights = {k: v for k, v in mx.load(str(unified.path / "model.safetensors")).items() if k.startswith("model.language_model.")}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {k.replace("model.language_model.", "model."): v for k, v in weights.items()})
    model = gemma4_mlx.load_model(tmp_path)
    ids = mx.array([[2, 40, 41, 42, 43]])
    assert rel_err(model(ids), np.array(unified.model(ids))) < 1e-6


@pytest.mark.parametrize("ordered", [False, True], ids=["dense-head", "centroid-head"])
def test_unified_drafter_keeps_greedy_tokens(unified, ordered, tmp_path):
    """The 12B's drafter (gemma4_unified_assistant; its logits against transformers' are in
    test_speculative.py): speculative decoding with it gives the plain greedy tokens."""
    hf = build_hf_assistant("unified", ordered=ordered)
    hf.save_pretrained(tmp_path)
    drafter = load_drafter(tmp_path)
    assert drafter.config.model_type == "gemma4_unified_assistant"
    drafter.check_target(unified.model.text_config)
    model, prompt = unified.model, mx.array([2, 5, 17, 99, 3, 44, 12])
    plain = [t for t, _ in generate_tokens(model, prompt, model.make_cache(), 30, make_sampler(0.0))]
    stats = SpeculativeStats()
    spec = [t for t, _ in speculative_tokens(model, drafter, prompt, model.make_cache(1), 30, make_sampler(0.0), num_draft_tokens=3, stats=stats)]
    assert spec == plain and stats.drafted > 0


@pytest.mark.parametrize("opts", [dict(quantize=True, q_bits=4, q_group_size=32), dict(quantize=True, q_bits=4, q_group_size=32, quantize_towers=True)],
                         ids=["4bit", "4bit-embedders-too"])  # fmt: skip
def test_converted_4bit_folder_loads_matches_and_drafts(unified, opts, tmp_path):
    """python -m convert on the 12B: the embedders stay float unless asked; the folder holds what
    convert.sizes computes, loads as the unified model, gives the dequantized weights' logits with
    media, and greedy decoding with a converted drafter equals plain decoding."""
    from checkpoints import dequantized_reference
    from convert import convert
    from convert.sizes import converted_bytes

    out = convert(str(unified.path), tmp_path / "q4", dtype="float32", progress=lambda _: None, **opts)
    written = sum(v.nbytes for f in out.glob("*.safetensors") for v in mx.load(str(f)).values())
    assert written == converted_bytes(json.loads((unified.path / "config.json").read_text()), dtype="float32", **opts)["total"]
    model, processor = gemma4_mlx.load(out)
    assert type(model).__name__ == "Gemma4UnifiedModel" and model.layers[0].self_attn.o_proj.bits == 4
    assert ("scales" in model.vision_embedder.patch_dense) == bool(opts.get("quantize_towers"))
    ids, media = multimodal_prompt()
    assert rel_err(model(mx.array(ids), **media), np.array(dequantized_reference(out, unified.path)(mx.array(ids), **media))) < 1e-4

    hf = build_hf_assistant("unified", ordered=True, hidden_size=64)  # widths a multiple of the group size
    hf.save_pretrained(tmp_path / "drafter_src")
    drafter = load_drafter(convert(str(tmp_path / "drafter_src"), tmp_path / "drafter", quantize=True, q_group_size=32, progress=lambda _: None))
    messages = [{"role": "user", "content": "Hello there"}]
    plain = gemma4_mlx.generate(model, processor, messages, max_tokens=16)
    assert plain and gemma4_mlx.generate(model, processor, messages, max_tokens=16, draft_model=drafter) == plain


def test_app_and_chat_take_the_12bs_images_audio_and_video(unified, tmp_path):
    """The app's backend on a 12B folder: every kind of media is accepted, and a chat turn with an
    image, a clip and a video replies (through the processor, the engine and prefix reuse)."""
    from helpers import random_image, tone

    from app.backend import ModelHolder, unsupported_media

    holder = ModelHolder(str(unified.path), None, draft=False).start()
    assert holder.ready.wait(120) and holder.engine is not None, holder.status
    assert holder.capabilities == {"image": True, "audio": True, "video": True}
    frames = np.stack([np.asarray(random_image(64, 48, i)) for i in range(3)])
    messages = [{"role": "user", "content": [
        {"type": "image", "image": random_image(96, 64, 0)}, {"type": "audio", "audio": tone(0.3)},
        {"type": "video", "video": frames}, {"type": "text", "text": "What is this?"}]}]  # fmt: skip
    assert unsupported_media([{"role": "user", "content": [{"type": "audio", "path": "a.wav"}]}], holder.capabilities) is None
    chunk = None
    for chunk in holder.engine.stream(messages, temperature=0.0, max_tokens=6):
        pass
    assert 0 < chunk.stats.generation_tokens <= 6 and chunk.stats.prompt_tokens > 3 * 20
    holder.close()
