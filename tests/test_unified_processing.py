"""The 12B unified model's processors against transformers 5.23's ``Gemma4UnifiedImageProcessor``,
``Gemma4UnifiedVideoProcessor``, ``Gemma4UnifiedAudioFeatureExtractor`` and ``Gemma4UnifiedProcessor``:
merged 48 px patches and their positions, raw audio frames, the expanded prompt, then the logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from checkpoints import build_hf_unified, save_checkpoint
from helpers import random_image, rel_err, tone
from PIL import Image
from torchvision_guard import import_torchvision

import gemma4_mlx
from gemma4_mlx.errors import MediaError
from gemma4_mlx.processing.unified import (
    UnifiedAudioFeatureExtractor,
    UnifiedImageProcessor,
    UnifiedVideoProcessor,
    patches_merge,
)

torchvision, REASON = import_torchvision()
pytestmark = pytest.mark.skipif(torchvision is None, reason=f"transformers' unified processors need it: {REASON}")
BUDGETS = (70, 140, 280, 560, 1120)


def hf_part(name: str, **settings):
    """transformers' unified image processor, video processor or audio feature extractor."""
    from transformers.models.gemma4_unified import (
        feature_extraction_gemma4_unified as audio,
        image_processing_gemma4_unified as image,
        video_processing_gemma4_unified as video,
    )

    classes = {"image": image.Gemma4UnifiedImageProcessor, "video": video.Gemma4UnifiedVideoProcessor,
               "audio": audio.Gemma4UnifiedAudioFeatureExtractor}  # fmt: skip
    return classes[name](**settings)


def frames(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """A video of uniform noise, uint8 [T, H, W, 3]: resize mistakes show in every frequency. (Flat
    patches are checked against the embedder in test_unified.py.)"""
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def assert_images_equal(ours: dict, ref, budget: int) -> None:
    assert ours["pixel_values"].shape == (len(ours["num_soft_tokens"]), budget, 6912)
    assert ours["pixel_values"].dtype == np.float32 and ours["image_position_ids"].dtype == np.int64
    np.testing.assert_allclose(ours["pixel_values"], ref["pixel_values"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ours["image_position_ids"], ref["image_position_ids"])
    assert ours["num_soft_tokens"] == list(ref["num_soft_tokens_per_image"])


# ---------------------------------------------------------------------------------------------- images
def test_patches_merge_matches_transformers():
    """The numpy port on a batch of 16 px patch grids, rows of kernels laid out as transformers does."""
    from transformers.models.gemma4_unified.image_processing_gemma4_unified import patches_merge as hf_merge

    gh, gw = 6, 9
    patches = np.random.default_rng(0).random((2, gh * gw, 4 * 4 * 3)).astype(np.float32)
    gx, gy = np.meshgrid(np.arange(gw), np.arange(gh), indexing="xy")
    positions = np.broadcast_to(np.stack([gx, gy], -1).reshape(1, -1, 2), (2, gh * gw, 2)).copy()
    merged, merged_positions = patches_merge(patches, positions, 6)
    ref, ref_positions = hf_merge(torch.from_numpy(patches), torch.from_numpy(positions), 6)
    np.testing.assert_array_equal(merged, ref.numpy())
    np.testing.assert_array_equal(merged_positions, ref_positions.numpy())
    # On a full grid: 12 px patches of the 24x36 image, row-major, at the 12 px grid's positions.
    image = patches[0].reshape(gh, gw, 4, 4, 3).transpose(0, 2, 1, 3, 4).reshape(gh * 4, gw * 4, 3)
    np.testing.assert_array_equal(merged[0], image.reshape(2, 12, 3, 12, 3).transpose(0, 2, 1, 3, 4).reshape(6, -1))
    assert merged_positions[0].tolist() == [[0, 0], [1, 0], [2, 0], [0, 1], [1, 1], [2, 1]]
    with pytest.raises(ValueError, match="cannot merge"):
        patches_merge(patches, positions, 5)


@pytest.mark.parametrize("budget", BUDGETS)
def test_images_match_transformers(budget):
    """Several sizes and aspect ratios in one call: downscaled, upscaled, thin, and one already at
    its target size (not resized); torch's resize, not Pillow's."""
    sizes = [(300, 200), (480, 640), (1080, 1920), (17, 500), (600, 9), (33, 47)]
    images = [random_image(h, w, seed) for seed, (h, w) in enumerate(sizes)]
    ours_proc = UnifiedImageProcessor()
    h, w = ours_proc.target_size(300, 200, budget)
    images.append(random_image(h, w, 9))  # at its target size already
    ours = ours_proc(images, max_soft_tokens=budget)
    ref = hf_part("image")(images, max_soft_tokens=budget, return_tensors="np")
    assert_images_equal(ours, ref, budget)
    assert ours["num_soft_tokens"] == [ours_proc.num_soft_tokens(im.height, im.width, budget) for im in images]


def test_image_inputs_and_settings_match_transformers():
    """One image, arrays, grayscale and transparent images, a processor built with another budget,
    another rescale, and a very elongated image (its long side capped, one row of 48 px patches)."""
    hf = hf_part("image", max_soft_tokens=140)
    rgba = np.asarray(random_image(90, 70, 3).convert("RGBA")).copy()
    rgba[..., 3] = np.arange(70, dtype=np.uint8)[None] * 3
    images = [np.array(random_image(200, 150, 1)), random_image(64, 64, 2).convert("L"), Image.fromarray(rgba)]
    assert_images_equal(UnifiedImageProcessor(max_soft_tokens=140)(images), hf(images, return_tensors="np"), 140)
    one = random_image(100, 130, 4)
    assert_images_equal(UnifiedImageProcessor()(one), hf_part("image")(one, return_tensors="np"), 280)
    settings = dict(rescale_factor=1 / 127.5, do_normalize=True, image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.3, 0.25])
    assert_images_equal(UnifiedImageProcessor(**settings)(one), hf_part("image", **settings)(one, return_tensors="np"), 280)

    thin = random_image(10, 4000, 5)
    ours = UnifiedImageProcessor()(thin, max_soft_tokens=70)
    assert_images_equal(ours, hf_part("image")(thin, max_soft_tokens=70, return_tensors="np"), 70)
    assert ours["num_soft_tokens"] == [70] and ours["image_position_ids"][0, :, 1].max() == 0
    assert ours["image_position_ids"][0, :, 0].max() == 69


def test_bad_image_inputs():
    with pytest.raises(ValueError, match="max_soft_tokens"):
        UnifiedImageProcessor(max_soft_tokens=100)
    with pytest.raises(ValueError, match="max_soft_tokens"):
        UnifiedImageProcessor()(random_image(48, 48), max_soft_tokens=300)
    with pytest.raises(ValueError, match="bicubic"):
        UnifiedImageProcessor(resample=2)
    with pytest.raises(MediaError, match="no images"):
        UnifiedImageProcessor()([])
    with pytest.raises(MediaError, match="does not merge"):
        UnifiedImageProcessor(do_resize=False)(random_image(48, 80))
    proc = UnifiedImageProcessor()
    proc.position_table_size = 64  # the model's mm_posemb_size
    assert proc(random_image(48, 2700), max_soft_tokens=70)["num_soft_tokens"] == [62]  # 62 positions fit
    with pytest.raises(MediaError, match="too elongated"):
        proc(random_image(48, 4000), max_soft_tokens=70)  # 70 do not


# ----------------------------------------------------------------------------------------------- video
@pytest.mark.parametrize("count,height,width,budget,num_frames", [
    (9, 48, 64, 70, 4),  # upscale, frames sampled
    (3, 720, 1280, 70, 3),  # downscale
    (3, 17, 500, 70, 3),  # thin
    (2, 384, 384, 70, 2),  # already the target size
    (2, 200, 150, 280, 2),
    (2, 64, 48, 1120, 2),
], ids=str)  # fmt: skip
def test_video_matches_transformers(count, height, width, budget, num_frames):
    video = frames(count, height, width)
    ref = hf_part("video", num_frames=num_frames)(
        video, video_metadata={"total_num_frames": count, "fps": 2.0}, max_soft_tokens=budget, return_metadata=True,
        return_tensors="np",
    )  # fmt: skip
    from gemma4_mlx.processing.video import load_video

    ours = UnifiedVideoProcessor(num_frames=num_frames)(load_video(video, num_frames, fps=2.0), max_soft_tokens=budget)
    assert ours["pixel_values_videos"].shape == (num_frames, budget, 6912) and ours["pixel_values_videos"].dtype == np.float32
    np.testing.assert_allclose(ours["pixel_values_videos"], ref["pixel_values_videos"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ours["video_position_ids"], ref["video_position_ids"])
    assert ours["num_soft_tokens"] == list(ref["num_soft_tokens_per_video"])
    seconds = np.asarray(ref["video_metadata"][0].frames_indices) / 2.0
    assert ours["timestamps"] == [[f"{int(s // 60):02d}:{int(s % 60):02d}" for s in seconds]]


def test_several_videos_match_transformers():
    videos = [frames(5, 90, 120, seed=1), frames(4, 300, 200, seed=2)]
    ref = hf_part("video", num_frames=4)(videos, return_metadata=True, return_tensors="np")
    ours = UnifiedVideoProcessor(num_frames=4)(videos)
    np.testing.assert_allclose(ours["pixel_values_videos"], ref["pixel_values_videos"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ours["video_position_ids"], ref["video_position_ids"])
    assert ours["num_soft_tokens"] == list(ref["num_soft_tokens_per_video"]) and list(ref["num_frames_per_video"]) == [4, 4]
    with pytest.raises(MediaError, match="do not split"):
        UnifiedVideoProcessor(do_resize=False)(frames(2, 40, 60))


# ----------------------------------------------------------------------------------------------- audio
def test_audio_matches_transformers():
    """Clips of exact multiples of 640 samples and not, one sample, in one batch and alone."""
    rng = np.random.default_rng(0)
    clips = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (640, 1280, 1000, 1, 16_005, 639)]
    hf = hf_part("audio")
    ours, ref = UnifiedAudioFeatureExtractor()(clips), hf(clips, return_tensors="np")
    assert ours["input_features"].shape == (6, 26, 640) and ours["input_features_mask"].dtype == bool
    np.testing.assert_array_equal(ours["input_features"], ref["input_features"])
    np.testing.assert_array_equal(ours["input_features_mask"], ref["input_features_mask"])
    assert ours["num_soft_tokens"] == [1, 2, 2, 1, 26, 1] == ref["input_features_mask"].sum(axis=1).tolist()
    one = UnifiedAudioFeatureExtractor()(clips[4])
    np.testing.assert_array_equal(one["input_features"], hf(clips[4], return_tensors="np")["input_features"])
    batch = np.stack([clips[2], clips[2][::-1]])  # a 2-D array: one clip per row, as in transformers
    ref = hf(list(batch), return_tensors="np")["input_features"]
    np.testing.assert_array_equal(UnifiedAudioFeatureExtractor()(batch)["input_features"], ref)


def test_audio_length_limit_and_rates(tmp_path):
    """30 s at most (750 frames), as transformers with ``max_length=audio_seq_length``; other rates
    are resampled to 16 kHz; files are read."""
    import soundfile as sf

    long = tone(31.0)
    ours = UnifiedAudioFeatureExtractor()([long, tone(0.1)])
    ref = hf_part("audio")([long, tone(0.1)], max_length=750, return_tensors="np")
    np.testing.assert_array_equal(ours["input_features"], ref["input_features"])
    assert ours["num_soft_tokens"] == [750, 3]
    assert UnifiedAudioFeatureExtractor(audio_seq_length=10)(long)["num_soft_tokens"] == [10]
    assert UnifiedAudioFeatureExtractor()(tone(1.0, rate=8000), sampling_rate=8000)["num_soft_tokens"] == [25]
    sf.write(tmp_path / "clip.wav", tone(0.5), 16_000)
    from_file = UnifiedAudioFeatureExtractor()(str(tmp_path / "clip.wav"))
    assert from_file["num_soft_tokens"] == [13]
    assert np.abs(from_file["input_features"][0].reshape(-1)[:8000] - tone(0.5)).max() < 1e-4  # 16-bit PCM


def test_bad_audio_inputs():
    with pytest.raises(MediaError, match="empty"):
        UnifiedAudioFeatureExtractor()([tone(0.2), np.zeros(0, np.float32)])
    with pytest.raises(MediaError, match="no audio"):
        UnifiedAudioFeatureExtractor()([])
    with pytest.raises(ValueError, match="16000"):
        UnifiedAudioFeatureExtractor(sampling_rate=8000)


# ------------------------------------------------------------------------------- the whole processor
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny 12B-shaped checkpoint with transformers' processor config (non-default settings), its
    transformers model and processor, and our model and processor loaded from the folder."""
    from transformers import AutoTokenizer
    from transformers.models.gemma4_unified.processing_gemma4_unified import Gemma4UnifiedProcessor

    hf_model = build_hf_unified()
    path = save_checkpoint(hf_model, tmp_path_factory.mktemp("unified_processor"), form="published")
    specials = dict(image_token="<|image|>", boi_token="<|image>", eoi_token="<image|>",
                    audio_token="<|audio|>", boa_token="<|audio>", eoa_token="<audio|>")  # the tiny tokenizer's  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(path), extra_special_tokens=specials)
    hf = Gemma4UnifiedProcessor(hf_part("audio"), hf_part("image", max_soft_tokens=140), tok, hf_part("video", num_frames=3))
    hf.save_pretrained(str(path))
    model, processor = gemma4_mlx.load(path)
    return hf_model, hf, model, processor


def test_processor_reads_the_checkpoints_settings(checkpoint):
    _, _, _, p = checkpoint
    assert isinstance(p.image_processor, UnifiedImageProcessor) and isinstance(p.video_processor, UnifiedVideoProcessor)
    assert isinstance(p.audio_extractor, UnifiedAudioFeatureExtractor)
    assert (p.image_processor.max_soft_tokens, p.video_processor.num_frames, p.audio_extractor.audio_seq_length) == (140, 3, 750)
    assert p.image_processor.position_table_size == 128  # the tiny model's mm_posemb_size


def test_processor_and_logits_match_transformers(checkpoint):
    """Images, clips and videos in one prompt: the same token ids (placeholders expanded, frames time
    stamped), arrays, and logits through each library's model."""
    hf_model, hf, model, p = checkpoint
    images = [random_image(300, 200, 11), random_image(40, 700, 12)]
    clips = [tone(0.41), tone(0.08, 200)]
    videos = [frames(7, 50, 70, seed=3), frames(3, 30, 90, seed=4)]
    text = (f"a {p.image_token} b {p.audio_token} c {p.video_token} d {p.image_token} "
            f"e {p.video_token} f {p.audio_token} g")  # fmt: skip
    ref = hf(text=[text], images=[images], audio=clips, videos=videos, return_tensors="np")
    ours = p(text, images=images, audio=clips, videos=videos)
    ids = np.array(ours["input_ids"])
    np.testing.assert_array_equal(ids, ref["input_ids"])
    config = model.config
    assert (ids == config.image_token_id).sum() == sum(p.image_processor.num_soft_tokens(im.height, im.width) for im in images)
    assert (ids == config.audio_token_id).sum() == 11 + 2 and (ids == config.video_token_id).sum() == 3 * 63 + 3 * 56
    assert p.decode(ids[0].tolist()).count("00:00 ") == 6
    pairs = [("pixel_values", "pixel_values"), ("image_position_ids", "image_position_ids"),
             ("pixel_values_videos", "pixel_values_videos"), ("video_position_ids", "video_position_ids"),
             ("input_features", "input_features"), ("input_features_mask", "input_features_mask")]  # fmt: skip
    for ours_key, ref_key in pairs:
        np.testing.assert_allclose(np.array(ours[ours_key]), ref[ref_key], rtol=0, atol=1e-6, err_msg=ours_key)

    inputs = {k: torch.from_numpy(np.asarray(v)) for k, v in ref.items()}
    with torch.no_grad():
        expected = hf_model(**inputs).logits.numpy()
    assert rel_err(model(**ours), expected) < 1e-4


def test_processor_config_fallbacks(tmp_path):
    """Flat preprocessor files and missing ones: defaults, or what the files say."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Gemma4UnifiedImageProcessor", "max_soft_tokens": 560}))  # fmt: skip
    (tmp_path / "feature_extractor_config.json").write_text(json.dumps(
        {"feature_extractor_type": "Gemma4UnifiedAudioFeatureExtractor", "padding_value": 0.5}))  # fmt: skip
    assert UnifiedImageProcessor.from_pretrained(tmp_path).max_soft_tokens == 560
    audio = UnifiedAudioFeatureExtractor.from_pretrained(tmp_path)
    assert (audio.padding_value, audio.audio_seq_length) == (0.5, 750)
    assert audio([tone(0.1), tone(0.01)])["input_features"][1, 1:].min() == 0.5  # padding frames
    assert UnifiedVideoProcessor.from_pretrained(tmp_path / "none").max_soft_tokens == 70


def test_chat_messages_match_transformers_chat_template(checkpoint):
    """A conversation with an image, a clip and a video in the 12B's chat template (the published
    one): transformers renders it and expands the placeholders; our messages give the same ids."""
    from gemma4_mlx.processing.processor import published_chat_template

    _, hf, _, p = checkpoint
    image, clip, video = random_image(120, 90, 21), tone(0.3), frames(3, 40, 60, seed=5)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": [{"type": "audio", "audio": clip}, {"type": "video", "video": video},
                                     {"type": "text", "text": "And these?"}]},
    ]  # fmt: skip
    for thinking in (False, True):
        text = hf.apply_chat_template(messages, chat_template=published_chat_template(), tokenize=False,
                                      add_generation_prompt=True, enable_thinking=thinking)  # fmt: skip
        ref = hf(text=[text], images=[[image]], audio=[clip], videos=[video], add_special_tokens=False, return_tensors="np")  # the text has its <bos>
        ours = p.prepare(messages, enable_thinking=thinking)
        np.testing.assert_array_equal(np.array(ours["input_ids"]), ref["input_ids"])
        np.testing.assert_allclose(np.array(ours["pixel_values"]), ref["pixel_values"], rtol=0, atol=1e-6)
