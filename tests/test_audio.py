"""Audio input and tower against transformers 5.23 (feature extractor, processor counts, Gemma4AudioModel)."""

import json
import shutil
import subprocess
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import soundfile as sf
import torch
from transformers.models.gemma4.configuration_gemma4 import Gemma4AudioConfig
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel, Gemma4MultimodalEmbedder
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

import helpers

from gemma4_mlx.models.audio import AudioConfig, AudioTower, encode_audio
from gemma4_mlx.processing.audio import AudioFeatureExtractor, load_audio
from gemma4_mlx.errors import MediaError
from gemma4_mlx.models.multimodal import MultimodalEmbedder

SR = 16_000
GOLDEN = {38560: 60, 48000: 75, 48800: 76, 99360: 155, 640000: 750}
FEATURE_ATOL = 1e-5  # measured: 0.0 (same numpy ops and dtypes as transformers)
TOWER_RTOL = 1e-4  # measured: ~6e-7


@pytest.fixture(scope="module")
def extractors():
    return AudioFeatureExtractor(), Gemma4AudioFeatureExtractor()


def tone(n, rate=SR, freq=440.0, amp=0.3):  # by sample count here
    return helpers.tone(n / rate, freq, rate, amp)


def noise(n, seed=0, amp=0.1):
    return (amp * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def hf_token_counts(hf_fe, hf_out, lengths):
    """The processor's two counts: from the mask (used in __call__) and from the sample count."""
    fake = SimpleNamespace(boa_token="<a>", audio_token="X", eoa_token="</a>", feature_extractor=hf_fe, audio_seq_length=750)
    from_mask = [Gemma4Processor.replace_audio_token(fake, hf_out, i).count("X") for i in range(len(lengths))]
    from_len = [Gemma4Processor._compute_audio_num_tokens(fake, np.zeros(n), SR) for n in lengths]
    return from_mask, from_len


def assert_features_match(extractors, clips):
    ours_fe, hf_fe = extractors
    ours = ours_fe(clips)
    ref = hf_fe(clips, return_tensors="np")
    assert ours["input_features"].dtype == np.float32 and ours["input_features_mask"].dtype == bool
    assert ours["input_features"].shape == ref["input_features"].shape
    np.testing.assert_array_equal(ours["input_features_mask"], ref["input_features_mask"])
    np.testing.assert_allclose(ours["input_features"], ref["input_features"], rtol=0, atol=FEATURE_ATOL)
    from_mask, from_len = hf_token_counts(hf_fe, ref, [len(c) for c in clips])
    assert ours["num_soft_tokens"] == from_mask == from_len
    return ours


# ----------------------------------------------------------------- features
@pytest.mark.parametrize("n", sorted(GOLDEN))
def test_golden_lengths(extractors, n):
    ours = assert_features_match(extractors, [tone(n) + noise(n)])
    assert ours["num_soft_tokens"] == [GOLDEN[n]]


@pytest.mark.parametrize("kind", ["tone", "silence", "noise", "chirp"])
@pytest.mark.parametrize("n", [321, 1000, 16001, 23457])
def test_single_clips_match_hf(extractors, kind, n):
    t = np.arange(n) / SR
    clip = {
        "tone": tone(n, freq=1234.5),
        "silence": np.zeros(n, np.float32),
        "noise": noise(n, seed=n, amp=0.5),
        "chirp": (0.5 * np.sin(2 * np.pi * (100 + 3000 * t) * t)).astype(np.float32),
    }[kind]
    assert_features_match(extractors, [clip])


def test_batch_of_mixed_lengths_matches_hf(extractors):
    clips = [tone(38560), np.zeros(5000, np.float32), noise(99360, seed=3), tone(48800, freq=3000.0) * 2]
    ours = assert_features_match(extractors, clips)
    assert ours["input_features"].shape[0] == 4
    assert ours["num_soft_tokens"][0] == 60 and ours["num_soft_tokens"][2] == 155 and ours["num_soft_tokens"][3] == 76
    # Padding frames are zero and invalid.
    assert not ours["input_features_mask"][1, 40:].any() and (ours["input_features"][1, 40:] == 0).all()


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resampled_rates_match_hf(extractors, rate):
    n = int(1.7 * rate)
    audio = load_audio(tone(n, rate=rate, freq=440.0) + noise(n, seed=rate, amp=0.01), sampling_rate=rate)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert abs(len(audio) - n * SR / rate) <= 1
    spectrum = np.abs(np.fft.rfft(audio))
    assert abs(np.argmax(spectrum) * SR / len(audio) - 440.0) < 2.0  # the tone survived resampling
    assert_features_match(extractors, [audio])


def test_stereo_mixdown(extractors):
    left, right = tone(30000, freq=300.0), noise(30000, seed=7)
    expected = (left + right) / 2
    for stereo in (np.stack([left, right]), np.stack([left, right], axis=1)):
        np.testing.assert_allclose(load_audio(stereo), expected, atol=1e-7)
    # At another rate the mixdown is resampled like a mono clip.
    mixed = load_audio(np.stack([left, right]), sampling_rate=22050)
    np.testing.assert_allclose(mixed, load_audio(expected, sampling_rate=22050), atol=1e-6)
    assert_features_match(extractors, [load_audio(np.stack([left, right]))])


def test_integer_pcm_is_scaled():
    pcm = (tone(4000) * 32767).astype(np.int16)
    np.testing.assert_allclose(load_audio(pcm), pcm / 32768.0, atol=1e-7)


def test_wav_and_flac_files(tmp_path, extractors):
    clip = tone(40000, freq=500.0) + noise(40000, seed=11, amp=0.05)
    wav = tmp_path / "clip.wav"
    sf.write(wav, clip, SR, subtype="PCM_16")
    np.testing.assert_allclose(load_audio(wav), clip, atol=1.0 / 32768 + 1e-7)
    np.testing.assert_allclose(load_audio(str(wav)), load_audio(wav))

    stereo = np.stack([tone(48000, rate=48000, freq=700.0), noise(48000, seed=12, amp=0.05)], axis=1)
    flac = tmp_path / "clip.flac"
    sf.write(flac, stereo, 48000, subtype="PCM_24")
    audio = load_audio(flac)
    assert len(audio) == 16000
    np.testing.assert_allclose(audio, load_audio(stereo.mean(axis=1), sampling_rate=48000), atol=1e-5)

    # Paths go straight into the extractor and give the same features as the decoded array.
    ours = extractors[0]([wav, flac])
    direct = extractors[0]([load_audio(wav), audio])
    np.testing.assert_array_equal(ours["input_features"], direct["input_features"])
    assert ours["num_soft_tokens"] == [63, 25]


def test_spoken_sentence(tmp_path, extractors):
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng) to synthesise speech")
    path = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(path), "The quick brown fox jumps over the lazy dog."], check=True)
    info = sf.info(str(path))
    audio = load_audio(path)
    assert abs(len(audio) - info.frames * SR / info.samplerate) <= 1
    ours = assert_features_match(extractors, [audio])
    assert ours["num_soft_tokens"][0] > 50  # about 2.8 s of speech at 25 tokens a second


def test_from_pretrained(tmp_path):
    default = AudioFeatureExtractor.from_pretrained(tmp_path)
    assert default.mel_floor == 1e-3 and default.audio_seq_length == 750 and default.feature_size == 128
    (tmp_path / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma4Processor",
        "audio_seq_length": 100,
        "feature_extractor": {"feature_extractor_type": "Gemma4AudioFeatureExtractor", "mel_floor": 0.01,
                              "max_length": 160000, "padding_side": "right", "return_attention_mask": True},
        "image_processor": {"mel_floor": 5.0},
    }))
    fe = AudioFeatureExtractor.from_pretrained(tmp_path)
    assert fe.mel_floor == 0.01 and fe.max_length == 160000 and fe.audio_seq_length == 100
    out = fe(tone(320000))
    assert out["input_features"].shape[1] == 999 and out["num_soft_tokens"] == [100]
    ref = Gemma4AudioFeatureExtractor(mel_floor=0.01)([tone(320000)], max_length=160000, return_tensors="np")
    np.testing.assert_allclose(out["input_features"], ref["input_features"], rtol=0, atol=FEATURE_ATOL)


# ----------------------------------------------------------------- bad input
def test_random_bytes_wav_raises(tmp_path):
    bad = tmp_path / "garbage.wav"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(MediaError, match="cannot read audio file .*garbage.wav"):
        load_audio(bad)


def test_missing_file_raises(tmp_path):
    with pytest.raises(MediaError, match="audio file not found: .*nope.flac"):
        load_audio(tmp_path / "nope.flac")
    with pytest.raises(MediaError, match="not found"):
        AudioFeatureExtractor()([str(tmp_path / "nope.flac")])


def test_bad_arrays_raise():
    with pytest.raises(MediaError, match="empty"):
        load_audio(np.zeros(0, np.float32))
    with pytest.raises(MediaError, match="NaN"):
        load_audio(np.array([0.0, np.nan, 0.1], np.float32))
    with pytest.raises(MediaError, match="1-D"):
        load_audio(np.zeros((2, 3, 4), np.float32))


@pytest.mark.parametrize("n", [1, 100, 160])
def test_clip_shorter_than_one_token_is_refused_clearly(n):
    # numpy's "window shape cannot be larger than input array shape" below ~100 samples, no token above.
    with pytest.raises(MediaError, match=rf"audio clip 2 is too short: {n} samples .* at least 161 samples"):
        AudioFeatureExtractor()([np.ones(16000, np.float32), np.zeros(n, np.float32)])
    assert AudioFeatureExtractor()([np.zeros(161, np.float32)])["num_soft_tokens"] == [1]


# ----------------------------------------------------------------- tower
def randomize(hf, embedder, seed=1):
    """Non-trivial weights everywhere: transformers initialises norms to 1, per_dim_scale to 0 and
    clip bounds to +-inf, which would hide mistakes. Linears get unit-scale outputs, so the finite
    clip bounds (+-1..2.5) actually clip."""
    g = torch.Generator().manual_seed(seed)
    u = lambda: float(torch.empty(()).uniform_(1.0, 2.5, generator=g))  # noqa: E731
    with torch.no_grad():
        for name, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            if name.endswith(("inv_timescales", "softcap")):
                continue
            if name.endswith(("input_min", "output_min")):
                p.fill_(-u())
            elif name.endswith(("input_max", "output_max")):
                p.fill_(u())
            elif "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("per_dim_scale"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p[0].numel()))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        w = embedder.embedding_projection.weight
        w.copy_(torch.randn(w.shape, generator=g) / np.sqrt(w.shape[1]))


def test_tower_matches_hf(extractors):
    torch.manual_seed(0)
    # transformers sizes input_proj_linear (channels[0] // 4) * channels[1], i.e. it assumes
    # channels[0] == 128 == mel bins, so the first conv keeps 128 channels here.
    hf_cfg = Gemma4AudioConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, subsampling_conv_channels=[128, 4],
        output_proj_dims=48, rms_norm_eps=1e-5,
    )
    hf = Gemma4AudioModel(hf_cfg).eval()
    hf_embed = Gemma4MultimodalEmbedder(hf_cfg, SimpleNamespace(hidden_size=40)).eval()
    randomize(hf, hf_embed)

    clips = [noise(20880, seed=5), tone(46400, freq=300.0) + noise(46400, seed=6, amp=0.02)]
    feats = extractors[0](clips)
    with torch.no_grad():
        out = hf(torch.tensor(feats["input_features"]), torch.tensor(feats["input_features_mask"]), return_dict=True)
        ref = hf_embed(out.last_hidden_state)[out.attention_mask].numpy()
    assert out.attention_mask.sum(-1).tolist() == feats["num_soft_tokens"] == [33, 73]

    cfg = AudioConfig.from_dict({**hf_cfg.to_dict(), "some_new_key": 7})
    assert cfg.extra["some_new_key"] == 7 and cfg.subsampling_conv_channels == [128, 4] and cfg.rms_norm_eps == 1e-5
    tower = AudioTower(cfg)
    weights = tower.sanitize({k: mx.array(v.numpy()) for k, v in hf.state_dict().items()})
    assert "rel_pos_enc.inv_timescales" not in weights
    assert weights["subsample_conv_projection.layer1.conv.weight"].shape == (4, 3, 3, 128)
    assert weights["layers.0.lconv1d.depthwise_conv1d.weight"].shape == (64, 5, 1)
    assert tower.sanitize(weights).keys() == weights.keys()  # idempotent on MLX-layout weights
    tower.load_weights(list(weights.items()), strict=True)
    embedder = MultimodalEmbedder(cfg.output_proj_dims, 40, eps=cfg.rms_norm_eps)
    embedder.load_weights([("embedding_projection.weight", mx.array(hf_embed.embedding_projection.weight.detach().numpy()))])

    ours = np.array(encode_audio(tower, embedder, feats["input_features"], feats["input_features_mask"]))
    assert ours.shape == ref.shape == (33 + 73, 40)
    err = float(np.abs(ours - ref).max() / np.abs(ref).max())
    print(f"audio tower + embedder relative error vs transformers: {err:.2e}")
    assert err < TOWER_RTOL

    # A clip alone gives the same tokens as in the batch (padding never leaks into valid tokens).
    alone = extractors[0](clips[:1])
    single = np.array(encode_audio(tower, embedder, alone["input_features"], alone["input_features_mask"]))
    assert float(np.abs(single - ours[:33]).max() / np.abs(ours[:33]).max()) < TOWER_RTOL


def test_browser_microphone_recording_webm_opus(tmp_path):
    """Browsers record the microphone as WebM/Opus, which libsndfile cannot read: PyAV decodes it."""
    from fractions import Fraction

    import av

    from gemma4_mlx.processing.audio import load_audio

    path = tmp_path / "recording.webm"
    rate = 48000
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)).astype(np.float32)[None]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libopus", rate=rate)
        stream.layout = "mono"
        for i in range(0, rate, 960):
            frame = av.AudioFrame.from_ndarray(tone[:, i : i + 960], format="flt", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = rate, i, Fraction(1, rate)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    audio = load_audio(path)
    assert abs(audio.size - 16000) <= 400  # one second at 16 kHz (the codec pads a little)
    spectrum = np.abs(np.fft.rfft(audio[2000:14000]))
    assert abs(np.argmax(spectrum) * 16000 / 12000 - 440) < 5  # still a 440 Hz tone


def test_long_recordings_are_decoded_only_as_far_as_used(tmp_path, extractors):
    """A clip is cut at 30 s: a long file is decoded only that far (plus a second for the resampler),
    with the same features as the whole file cut afterwards."""
    rate = 44_100
    long = (0.2 * np.sin(np.arange(rate * 300) / rate * 2 * np.pi * 330)).astype(np.float32)  # 5 minutes
    path = tmp_path / "long.flac"
    sf.write(path, long, rate)
    decoded = load_audio(path, max_seconds=30)
    assert 30 * 16_000 <= len(decoded) <= 31 * 16_000 + 100
    ours, _ = extractors
    whole = ours([load_audio(path)])
    limited = ours([str(path)])
    assert limited["num_soft_tokens"] == whole["num_soft_tokens"] == [750]
    np.testing.assert_array_equal(limited["input_features"], whole["input_features"])
