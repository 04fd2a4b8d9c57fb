"""The merged multimodal forward pass against transformers 5.23, and the multimodal processor."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import AUDIO, LARGE_VIT, SMALL_VIT, build_hf_model, save_checkpoint
from helpers import messages_with, random_image, rel_err, to_torch, tone

import gemma4_mlx
from gemma4_mlx.generation.decode import prefill
from gemma4_mlx.errors import MediaError

class MM:
    def __init__(self, family, tmp, **towers):
        self.hf = build_hf_model(family, **towers)
        for sub in ("vision_config", "audio_config"):
            if getattr(self.hf.config, sub, None) is not None:
                getattr(self.hf.config, sub)._attn_implementation = "eager"
        self.path = save_checkpoint(self.hf, tmp)
        self.model, self.processor = gemma4_mlx.load(self.path)


@pytest.fixture(scope="module")
def e2b_mm(tmp_path_factory):
    return MM("e2b", tmp_path_factory.mktemp("e2b_mm"), vision_config=SMALL_VIT, audio_config=AUDIO)


@pytest.fixture(scope="module")
def moe_mm(tmp_path_factory):
    return MM("moe26b", tmp_path_factory.mktemp("moe_mm"), vision_config=LARGE_VIT)


def test_e2b_image_and_audio_logits_match_hf(e2b_mm):
    msgs = messages_with(
        {"type": "image", "image": random_image(120, 90, 0)},
        {"type": "audio", "audio": tone(0.6)},
        {"type": "image", "image": random_image(40, 200, 1)},
    )
    inputs = e2b_mm.processor.prepare(msgs, max_soft_tokens=70)
    ids = np.array(inputs["input_ids"])
    assert (ids == e2b_mm.model.config.image_token_id).sum() > 0 and (ids == e2b_mm.model.config.audio_token_id).sum() > 0
    with torch.no_grad():
        ref = e2b_mm.hf(**to_torch(inputs)).logits.numpy()
    ours = e2b_mm.model(**inputs)
    assert rel_err(ours, ref) < 1e-4


def test_moe_bidirectional_image_logits_match_hf(moe_mm):
    msgs = messages_with({"type": "image", "image": random_image(64, 64, 2)}, {"type": "image", "image": random_image(90, 30, 3)})
    inputs = moe_mm.processor.prepare(msgs, max_soft_tokens=70)
    with torch.no_grad():
        ref = moe_mm.hf(**to_torch(inputs)).logits.numpy()
        causal = moe_mm.hf(**{k: v for k, v in to_torch(inputs).items() if k != "mm_token_type_ids"}).logits.numpy()
    assert rel_err(causal, ref) > 1e-3  # the bidirectional image blocks really change the result
    assert rel_err(moe_mm.model(**inputs), ref) < 1e-4


@pytest.mark.parametrize("fixture", ["e2b_mm", "moe_mm"])
def test_cached_decoding_after_multimodal_prompt_matches_full_forward(fixture, request):
    mm = request.getfixturevalue(fixture)
    items = [{"type": "image", "image": random_image(70, 100, 4)}]
    if mm.model.has_audio:
        items.append({"type": "audio", "audio": tone(0.4, 300)})
    inputs = mm.processor.prepare(messages_with(*items))
    ids = inputs.pop("input_ids")
    extra = mx.array([[40, 41, 42, 43]])
    full_ids = mx.concatenate([ids, extra], axis=1)
    full = np.array(mm.model(full_ids, **inputs))
    embeds = mm.model.embed_multimodal(ids, **inputs)[0]
    cache = mm.model.make_cache()
    # Small chunks force chunk ends into image blocks; prefill must move them out.
    n = ids.shape[1] - 1
    blocks = mm.model.vision_block_ids(np.array(ids))  # the request pipeline finds them once
    done = prefill(mm.model, ids[0, :n], cache, 13, inputs_embeds=embeds[:n], vision_blocks=None if blocks is None else blocks[0, :n])
    assert done == n
    steps = [np.array(mm.model(ids[:, n:], cache=cache, inputs_embeds=embeds[None, n:]))]
    for t in range(extra.shape[1]):
        steps.append(np.array(mm.model(extra[:, t : t + 1], cache=cache)))
    cached = np.concatenate(steps, axis=1)
    assert rel_err(cached, full[:, ids.shape[1] - 1 :]) < 1e-4


def test_generation_with_media_runs_encoders_once(e2b_mm, monkeypatch):
    calls = []
    original = e2b_mm.model.embed_multimodal
    monkeypatch.setattr(e2b_mm.model, "embed_multimodal", lambda *a, **k: calls.append(1) or original(*a, **k))
    msgs = messages_with({"type": "image", "image": random_image(50, 50, 5)}, {"type": "audio", "audio": tone(0.3)})
    chunks = list(gemma4_mlx.stream_generate(e2b_mm.model, e2b_mm.processor, msgs, max_tokens=6))
    assert len(chunks) >= 1 and len(calls) == 1
    # Same greedy tokens as a plain full forward step by step would pick first.
    inputs = e2b_mm.processor.prepare(msgs)
    first = int(np.array(e2b_mm.model(**inputs))[0, -1].argmax())
    assert chunks[0].token == first


def test_processor_expands_placeholders(e2b_mm):
    p = e2b_mm.processor
    out = p(f"a {p.image_token} b {p.audio_token} c", images=[random_image(48, 48, 6)], audio=[tone(1.0)], max_soft_tokens=70)
    ids = np.array(out["input_ids"])[0]
    cfg = e2b_mm.model.config
    n_img = int((ids == cfg.image_token_id).sum())
    assert n_img == 64  # 48x48 at budget 70 -> upscaled to 384x384 -> (24*24)/9
    assert int((ids == cfg.audio_token_id).sum()) == 25  # 16000 samples -> 25 tokens (40 ms each)
    boi = list(ids).index(cfg.boi_token_id)
    assert ids[boi + 1 + n_img] == cfg.eoi_token_id
    assert out["pixel_values"].shape == (1, 630, 768)


def test_video_frames_are_time_stamped(e2b_mm, tmp_path):
    frames = np.random.default_rng(0).integers(0, 256, (40, 48, 64, 3), dtype=np.uint8)
    p = e2b_mm.processor
    out = p(f"watch {p.video_token}", videos=[frames])
    text = p.decode(np.array(out["input_ids"])[0].tolist())
    assert text.count(p.boi_token) == 32 and "00:01 " in text
    assert out["pixel_values_videos"].shape[0] == 32
    # A real encoded video file goes through PyAV.
    av = pytest.importorskip("av", reason="PyAV decodes video files")
    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=8)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for f in frames[:20]:
            for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    out = p(f"{p.video_token}", videos=[str(path)])
    logits = e2b_mm.model(**out)
    assert logits.shape[1] == out["input_ids"].shape[1]


def test_bad_multimodal_input(e2b_mm, moe_mm, tmp_path):
    with pytest.raises(MediaError, match="no audio tower"):
        moe_mm.processor.prepare(messages_with({"type": "audio", "audio": tone(0.5)}))
    p = e2b_mm.processor
    with pytest.raises(MediaError, match="2 image placeholder"):
        p(f"{p.image_token} {p.image_token}", images=[random_image(30, 30, 7)])
    with pytest.raises(MediaError, match="0 image placeholder"):
        p("no placeholder", images=[random_image(30, 30, 7)])
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not an image at all")
    with pytest.raises(MediaError, match="broken.png"):
        p.prepare(messages_with({"type": "image", "path": str(bad)}))
    # An image too elongated for the vision tower's position table (128 entries here) is named.
    table = e2b_mm.model.vision_tower.config.position_embedding_size
    with pytest.raises(MediaError, match=rf"image 2 \(4000x2 px\) is too elongated .* positions for {table}"):
        p.prepare(messages_with({"type": "image", "image": random_image(30, 30, 7)}, {"type": "image", "image": np.zeros((2, 4000, 3), np.uint8)}))
    ids = p(f"x {p.image_token}", images=[random_image(30, 30, 8)])["input_ids"]
    # model(ids) alone treats placeholders as padding, as transformers does; merging media checks them.
    with pytest.raises(MediaError, match="no image input"):
        e2b_mm.model.embed_multimodal(ids, input_features=mx.zeros((1, 200, 128)), input_features_mask=mx.ones((1, 200)))


def test_cli_takes_an_image(e2b_mm, tmp_path):
    import subprocess
    import sys

    img = tmp_path / "pic.png"
    random_image(60, 80, 9).save(img)
    run = subprocess.run(
        [sys.executable, "-m", "gemma4_mlx", "--model", str(e2b_mm.path), "--prompt", "what is this?",
         "--image", str(img), "--image-tokens", "70", "--max-tokens", "3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "prompt:" in run.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "gemma4_mlx", "--model", str(e2b_mm.path), "--prompt", "x", "--image", str(tmp_path / "nope.png")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 1 and missing.stderr.startswith("error:") and "nope.png" in missing.stderr


def test_file_urls_in_messages(e2b_mm, tmp_path):
    img = tmp_path / "u.png"
    random_image(40, 40, 10).save(img)
    by_url = e2b_mm.processor.prepare(messages_with({"type": "image", "url": img.as_uri()}))
    by_path = e2b_mm.processor.prepare(messages_with({"type": "image", "path": str(img)}))
    assert np.array_equal(np.array(by_url["pixel_values"]), np.array(by_path["pixel_values"]))
    with pytest.raises(MediaError, match="scheme"):
        e2b_mm.processor.prepare(messages_with({"type": "image", "url": "ftp://example/x.png"}))


@pytest.mark.parametrize("budget", [70, 280, 1120])
def test_processor_matches_hf_gemma4_processor(e2b_mm, budget, monkeypatch):
    """Whole-processor parity: placeholder expansion, token ids, pixels and audio features.

    transformers' processor insists on a video processor, which needs torchvision (no CPU build
    here), so its class check is bypassed and the processor is built without one.
    """
    from transformers import AutoTokenizer
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.processing_utils import ProcessorMixin

    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda *a, **k: None)
    p = e2b_mm.processor
    specials = dict(image_token=p.image_token, boi_token=p.boi_token, eoi_token=p.eoi_token,
                    audio_token=p.audio_token, boa_token=p.boa_token, eoa_token=p.eoa_token)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(e2b_mm.path), extra_special_tokens=specials)
    hf = Gemma4Processor(Gemma4AudioFeatureExtractor(), Gemma4ImageProcessorPil(), tok, None)
    images = [random_image(300, 200, 11), random_image(17, 500, 12)]
    # The thin image spans more patches than the tiny tower's 128 positions, which our processor
    # refuses (test_bad_multimodal_input); transformers' processor does not know the tower's table.
    monkeypatch.setattr(p.image_processor, "position_table_size", None)
    clips = [tone(2.41), tone(0.77, 200)]
    text = f"x {p.image_token} y {p.audio_token} z {p.image_token} w {p.audio_token}"
    ref = hf(text=[text], images=[images], audio=clips, max_soft_tokens=budget, return_tensors="np")
    ours = p(text, images=images, audio=clips, max_soft_tokens=budget)
    assert np.array_equal(np.array(ours["input_ids"]), ref["input_ids"])
    np.testing.assert_allclose(np.array(ours["pixel_values"]), ref["pixel_values"], atol=1e-6)
    assert np.array_equal(np.array(ours["image_position_ids"]), ref["image_position_ids"])
    np.testing.assert_allclose(np.array(ours["input_features"]), ref["input_features"], atol=1e-5)
    assert np.array_equal(np.array(ours["input_features_mask"]), ref["input_features_mask"])


@pytest.fixture
def http_server(tmp_path):
    """A local HTTP server over ``tmp_path``; ``/endless`` streams bytes with no Content-Length."""
    import functools
    import http.server
    import threading

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/endless":
                return super().do_GET()
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(64):
                    self.wfile.write(b"\0" * 65536)
            except OSError:  # the client gave up, as it should
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_media_are_bounded_and_never_left_behind(e2b_mm, tmp_path, http_server, monkeypatch):
    import tempfile

    from gemma4_mlx.processing import sources

    leftovers = lambda: sorted(Path(tempfile.gettempdir()).glob("gemma4-media-*"))  # noqa: E731
    before = leftovers()
    img = tmp_path / "pic.png"
    random_image(40, 40, 10).save(img)
    p = e2b_mm.processor
    by_url = p.prepare(messages_with({"type": "image", "url": f"{http_server}/pic.png"}))
    by_path = p.prepare(messages_with({"type": "image", "path": str(img)}))
    assert np.array_equal(np.array(by_url["pixel_values"]), np.array(by_path["pixel_values"]))
    with pytest.raises(MediaError, match="cannot download .*missing.png"):
        p.prepare(messages_with({"type": "image", "url": f"{http_server}/missing.png"}))
    monkeypatch.setattr(sources, "MAX_DOWNLOAD_BYTES", 1_000_000)
    (tmp_path / "big.png").write_bytes(b"\0" * 2_000_000)
    with pytest.raises(MediaError, match="big.png is 2 MB, more than the 1 MB"):  # told by Content-Length
        p.prepare(messages_with({"type": "image", "url": f"{http_server}/big.png"}))
    with pytest.raises(MediaError, match="endless is more than the 1 MB"):  # counted while streaming
        p.prepare(messages_with({"type": "image", "url": f"{http_server}/endless"}))
    # A failure after the download (not an image) removes the file too.
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(MediaError, match="cannot read image"):
        p.prepare(messages_with({"type": "image", "url": f"{http_server}/text.png"}))
    assert leftovers() == before


def test_speculative_decoding_after_a_multimodal_prompt(e2b_mm, tmp_path):
    """With a drafter, a reply to an image-and-audio prompt is the reply without it (greedy)."""
    from checkpoints import build_hf_assistant

    build_hf_assistant("e2b").save_pretrained(tmp_path)
    msgs = messages_with({"type": "image", "image": random_image(70, 100, 4)}, {"type": "audio", "audio": tone(0.4, 300)})
    plain = gemma4_mlx.generate(e2b_mm.model, e2b_mm.processor, msgs, max_tokens=12)
    chunks = list(gemma4_mlx.stream_generate(e2b_mm.model, e2b_mm.processor, msgs, max_tokens=12, draft_model=str(tmp_path), num_draft_tokens=3))
    assert "".join(c.text for c in chunks) == plain and chunks[-1].draft.target_steps > 0
