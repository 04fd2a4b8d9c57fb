"""Video: the frame resize and the video processor against transformers 5.23's ``Gemma4VideoProcessor``
(torchvision's uint8 antialiased bicubic), bit for bit; the whole processor and the logits with video."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import build_hf_model, save_checkpoint
from PIL import Image
from torchvision_guard import import_torchvision

import gemma4_mlx
from gemma4_mlx.errors import MediaError
from gemma4_mlx.processing.resize import axis_weights, resize_bicubic_antialias
from gemma4_mlx.processing.video import VideoProcessor, load_video

torchvision, REASON = import_torchvision()
needs_torchvision = pytest.mark.skipif(torchvision is None, reason=f"transformers' video processor needs it: {REASON}")


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
    resize = lambda f: np.asarray(Image.fromarray(f).resize((width, height), Image.BICUBIC, reducing_gap=None))  # noqa: E731
    return np.stack([resize(f) for f in images])


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
        ours = resize_bicubic_antialias(frames, h, w)
        np.testing.assert_array_equal(ours, torch_resize(frames, h, w), err_msg=f"{H}x{W}->{h}x{w}")


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


@needs_torchvision
def test_resize_matches_torchvision():
    """What transformers calls: torchvision's resize of uint8 [T, C, H, W] frames."""
    from torchvision.transforms.v2 import functional as tvF

    frames = noise_video(3, 100, 130)
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    for h, w in [(96, 144), (336, 432), (48, 48)]:
        ref = tvF.resize(x, [h, w], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        np.testing.assert_array_equal(resize_bicubic_antialias(frames, h, w), ref.permute(0, 2, 3, 1).numpy())


# ------------------------------------------------------------------------------------------- processor
def hf_video_processor(**settings):
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

    return Gemma4VideoProcessor(**settings)


def labels(seconds) -> list[str]:
    return [f"{int(s // 60):02d}:{int(s % 60):02d}" for s in seconds]


def assert_same(ours: dict, ref) -> None:
    """Bit-identical: pixels (max abs diff 0), positions, soft tokens, time stamps."""
    pixels = ref["pixel_values_videos"]
    assert ours["pixel_values_videos"].dtype == pixels.dtype == np.float32
    assert ours["pixel_values_videos"].shape == pixels.shape
    assert np.abs(ours["pixel_values_videos"] - pixels).max() == 0
    np.testing.assert_array_equal(ours["video_position_ids"], ref["video_position_ids"])
    assert ours["num_soft_tokens"] == list(ref["num_soft_tokens_per_video"])
    # frame index / fps, with transformers' processor's 24 fps where none is known
    assert ours["timestamps"] == [labels(np.asarray(m.frames_indices) / (m.fps or 24)) for m in ref["video_metadata"]]


@needs_torchvision
@pytest.mark.parametrize(
    "frames,height,width,budget,num_frames",
    [
        (40, 48, 64, 70, 32),  # upscale; frames sampled as arange(32) * 40 // 32
        (5, 97, 131, 70, 4),  # odd sizes
        (4, 720, 1280, 70, 4),  # downscale
        (4, 17, 500, 70, 4),  # thin: one row of pooling cells
        (4, 600, 9, 70, 4),
        (4, 2, 2, 70, 4),  # (transformers reads frames 1 or 3 pixels high as channels-first)
        (4, 5, 1, 70, 4),
        (4, 384, 384, 70, 4),  # already the target size: no resize
        (2, 90, 160, 140, 2),
        (6, 200, 150, 280, 4),
        (2, 500, 333, 560, 2),
        (3, 64, 48, 1120, 2),
    ],
    ids=lambda v: str(v),
)
def test_processor_matches_transformers(frames, height, width, budget, num_frames):
    video = noise_video(frames, height, width)
    fps = 0.5  # time stamps past a minute
    ref = hf_video_processor(num_frames=num_frames)(
        video, video_metadata={"total_num_frames": frames, "fps": fps}, max_soft_tokens=budget,
        return_metadata=True, return_tensors="np",
    )  # fmt: skip
    ours = VideoProcessor(num_frames=num_frames)(load_video(video, num_frames, fps=fps), max_soft_tokens=budget)
    assert_same(ours, ref)
    assert ours["pixel_values_videos"].shape[:2] == (num_frames, budget * 9)
    # The old path (Pillow, as for images) is caught whenever the frames are resized.
    w, h = (ours["video_position_ids"][0].max(axis=0) + 1) * 16  # positions are (x, y)
    if (h, w) != (height, width):
        sampled = video[np.arange(num_frames) * frames // num_frames]
        assert not np.array_equal(pillow_resize(sampled, h, w), resize_bicubic_antialias(sampled, h, w))


@needs_torchvision
def test_several_videos_and_settings_match_transformers():
    """Videos of different sizes concatenate along frames; the rescale settings: fused into the
    normalisation (float32 division) as by default, with another mean and std, or a plain rescale."""
    videos = [noise_video(8, 90, 120, seed=1), noise_video(11, 300, 200, seed=2)]
    ref = hf_video_processor(num_frames=8)(videos, return_metadata=True, return_tensors="np")
    assert_same(VideoProcessor(num_frames=8)(videos), ref)
    for settings in [dict(image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.3, 0.25]), dict(do_normalize=False),
                     dict(do_rescale=False, do_normalize=False), dict(rescale_factor=1 / 127.5)]:  # fmt: skip
        ref = hf_video_processor(num_frames=4, **settings)(videos[1], return_metadata=True, return_tensors="np")
        if ref["pixel_values_videos"].dtype == np.uint8:  # neither rescaled nor normalised: ours are float32
            ref["pixel_values_videos"] = ref["pixel_values_videos"].astype(np.float32)
        assert_same(VideoProcessor(num_frames=4, **settings)(videos[1]), ref)


def write_video(path, frames: np.ndarray, rate: int = 8) -> None:
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@needs_torchvision
def test_video_file_matches_transformers(tmp_path):
    """A file decoded with PyAV: the same frames, time stamps and outputs as transformers' PyAV reader
    followed by its video processor (its default readers, torchcodec and torchvision's, are not here)."""
    from transformers.video_utils import load_video as hf_load_video

    path = tmp_path / "clip.mp4"
    write_video(path, noise_video(45, 96, 160), rate=8)
    hf = hf_video_processor()
    frames, metadata = hf_load_video(str(path), backend="pyav", sample_indices_fn=hf.sample_frames)
    clip = load_video(path)
    np.testing.assert_array_equal(clip.frames, frames)
    assert clip.timestamps == metadata.timestamps and clip.timestamp_labels()[-1] == "00:05"
    ref = hf(frames, video_metadata=metadata, do_sample_frames=False, return_metadata=True, return_tensors="np")
    assert_same(VideoProcessor()(str(path)), ref)
    # A video shorter than 32 frames keeps every frame (transformers raises unless asked for that many).
    write_video(path, noise_video(20, 64, 48), rate=8)
    ours = VideoProcessor()(str(path))
    every_frame = lambda metadata: hf.sample_frames(metadata, num_frames=20)  # noqa: E731
    frames, metadata = hf_load_video(str(path), backend="pyav", sample_indices_fn=every_frame)
    ref = hf(frames, video_metadata=metadata, do_sample_frames=False, return_metadata=True, return_tensors="np")
    assert_same(ours, ref)
    assert len(ours["timestamps"][0]) == 20


def test_video_processor_config_and_errors(tmp_path):
    import json

    (tmp_path / "processor_config.json").write_text(json.dumps({
        "image_processor": {"max_soft_tokens": 280},
        "video_processor": {"num_frames": 8, "max_soft_tokens": 140, "do_normalize": False, "image_mean": None},
    }))  # fmt: skip
    vp = VideoProcessor.from_pretrained(tmp_path)
    assert (vp.num_frames, vp.max_soft_tokens, vp.do_normalize) == (8, 140, False)
    out = vp(noise_video(10, 40, 60))
    assert out["pixel_values_videos"].shape == (8, 140 * 9, 768) and len(out["timestamps"][0]) == 8
    assert VideoProcessor.from_pretrained(tmp_path / "nothing").num_frames == 32
    with pytest.raises(ValueError, match="max_soft_tokens"):
        VideoProcessor(max_soft_tokens=100)
    with pytest.raises(ValueError, match="bicubic"):
        VideoProcessor(resample=2)
    with pytest.raises(MediaError, match="not found"):
        vp(str(tmp_path / "missing.mp4"))
    with pytest.raises(MediaError, match="do not split"):
        VideoProcessor(do_resize=False)(noise_video(2, 40, 60))
    # RGBA frames: transparency onto white (opaque frames just drop alpha), as for images.
    rgba = np.concatenate([noise_video(2, 8, 8), np.full((2, 8, 8, 1), 255, np.uint8)], axis=-1)
    np.testing.assert_array_equal(load_video(rgba).frames, noise_video(2, 8, 8))
    rgba[..., 3] = 0
    assert (load_video(rgba).frames == 255).all()


# ----------------------------------------------------------------------------- processor and logits
@pytest.fixture(scope="module")
def e2b_vision(tmp_path_factory):
    vit = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
               head_dim=16, use_clipped_linears=True, position_embedding_size=128)  # fmt: skip
    hf = build_hf_model("e2b", vision_config=vit)
    hf.config.vision_config._attn_implementation = "eager"
    path = save_checkpoint(hf, tmp_path_factory.mktemp("e2b_video"))
    model, processor = gemma4_mlx.load(path)
    return hf, path, model, processor


@needs_torchvision
def test_processor_and_logits_match_transformers(e2b_vision, monkeypatch):
    """Gemma4Processor with its video processor: the expanded prompt (time stamps, placeholders), the
    pixels and positions; then the logits of the merged forward pass."""
    from transformers import AutoTokenizer
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.processing_utils import ProcessorMixin

    hf_model, path, model, p = e2b_vision
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda *a, **k: None)  # the PIL image processor
    specials = dict(image_token=p.image_token, boi_token=p.boi_token, eoi_token=p.eoi_token,
                    audio_token=p.audio_token, boa_token=p.boa_token, eoa_token=p.eoa_token)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(path), extra_special_tokens=specials)
    hf = Gemma4Processor(Gemma4AudioFeatureExtractor(), Gemma4ImageProcessorPil(), tok, hf_video_processor(num_frames=3))
    monkeypatch.setattr(p, "video_processor", VideoProcessor(num_frames=3))
    videos = [noise_video(7, 50, 70, seed=3), noise_video(3, 30, 90, seed=4)]
    text = f"first {p.video_token} then {p.video_token} and {p.image_token}"
    images = [Image.fromarray(noise_video(1, 60, 40, seed=5)[0])]
    ref = hf(text=[text], images=[images], videos=videos, images_kwargs={"max_soft_tokens": 70}, return_tensors="np")
    ours = p(text, images=images, videos=videos, max_soft_tokens=70)
    ids = np.array(ours["input_ids"])
    np.testing.assert_array_equal(ids, ref["input_ids"])
    assert (ids == model.config.video_token_id).sum() == 3 * 63 + 3 * 56  # 50x70 -> 336x432, 30x90 -> 192x672
    assert p.decode(ids[0].tolist()).count("00:00 ") == 6
    np.testing.assert_array_equal(np.array(ours["pixel_values_videos"]), ref["pixel_values_videos"])
    np.testing.assert_array_equal(np.array(ours["video_position_ids"]), ref["video_position_ids"])

    assert list(ref["num_frames_per_video"]) == [3, 3]
    inputs = {k: torch.from_numpy(np.asarray(v)) for k, v in ref.items()}
    with torch.no_grad():
        expected = hf_model(**inputs).logits.numpy()
    logits = np.array(model(**ours).astype(mx.float32))
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-4
