"""Audio input: decode, resample to 16 kHz mono, and compute Gemma 4's log-mel features.

:class:`AudioFeatureExtractor` reproduces transformers 5.23's ``Gemma4AudioFeatureExtractor``
step by step (same dtypes, same FFT), so features match it to float32 rounding: 128 HTK mel bins
over 0-8000 Hz of the magnitude of a 512-point rFFT of 20 ms periodic-Hann frames every 10 ms,
``log(mel + 1e-3)``, with 10 ms of zeros prepended (semicausal framing). librosa's HTK filterbank
(``norm=None``, float64) is bit-identical to transformers' ``mel_filter_bank``, so it is used as is.

Why not call transformers' numpy ``Gemma4AudioFeatureExtractor`` itself: its batching, padding and
return types follow transformers' feature-extraction conventions (``BatchFeature``, whose tensor
conversion imports torch where it is installed), while we need per-clip frame masks to count each
clip's soft tokens, file decoding cut at 30 s and errors that name the clip; the mel math is the same
twenty lines, tested equal to transformers' to float32 rounding.
"""

from __future__ import annotations

import inspect
import math
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..config import read_json_object
from ..errors import MediaError

SAMPLING_RATE = 16_000
MAX_SAMPLES = 480_000  # 30 s: longer clips are cut, as transformers does
AUDIO_SEQ_LENGTH = 750  # soft tokens per clip at most (30 s at 40 ms a token)


def load_audio(source, sampling_rate: int | None = None, max_seconds: float | None = None) -> np.ndarray:
    """A clip as float32 mono at 16 kHz, from a file path (wav, flac, mp3, ogg, ...) or an array.

    An array is taken at ``sampling_rate`` Hz (16000 if not given); a 2-D array is multi-channel
    (channels on the shorter axis) and is averaged to mono. Integer arrays are scaled to [-1, 1).
    ``max_seconds`` stops decoding a file there (a two-hour recording is not read whole to keep
    its first 30 s); the result may run a little longer, for the resampler's sake.
    """
    if isinstance(source, (str, Path)):
        audio, rate = _decode_file(Path(source), max_seconds)
    else:
        audio = np.asarray(source)
        rate = SAMPLING_RATE if sampling_rate is None else int(sampling_rate)
        if audio.ndim == 2:
            audio = audio.mean(axis=0 if audio.shape[0] <= audio.shape[1] else 1)
        elif audio.ndim != 1:
            raise MediaError(f"an audio array must be 1-D (mono) or 2-D (multi-channel), got shape {audio.shape}")
        if np.issubdtype(audio.dtype, np.integer):
            audio = audio / float(np.iinfo(audio.dtype).max + 1)
        elif not np.issubdtype(audio.dtype, np.floating):
            raise MediaError(f"an audio array must hold numbers, got dtype {audio.dtype}")
    if rate <= 0:
        raise MediaError(f"invalid sampling rate {rate}")
    audio = np.asarray(audio, dtype=np.float32)
    if audio.size == 0:
        raise MediaError("the audio clip is empty")
    if not np.isfinite(audio).all():
        raise MediaError("the audio clip holds NaN or infinite samples")
    if rate != SAMPLING_RATE:
        import librosa

        audio = librosa.resample(audio, orig_sr=rate, target_sr=SAMPLING_RATE).astype(np.float32)
    return np.ascontiguousarray(audio)


def _decode_file(path: Path, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """Samples (mono, float32) and rate of an audio file: libsndfile first, then librosa's fallbacks.
    Decoding stops after ``max_seconds`` plus a second of margin (kept for the resampler's filter)."""
    if not path.is_file():
        raise MediaError(f"audio file not found: {path}")
    import soundfile as sf

    keep = None if max_seconds is None else max_seconds + 1.0
    try:
        with sf.SoundFile(str(path)) as f:
            frames = -1 if keep is None else int(keep * f.samplerate)
            data = f.read(frames, dtype="float32", always_2d=True)
            return data.mean(axis=1), int(f.samplerate)
    except Exception as e:  # libsndfile cannot read it (webm/opus from a browser microphone, m4a, ...)
        first = e
    try:
        return _decode_with_av(path, keep), SAMPLING_RATE
    except Exception:  # noqa: S110 - PyAV cannot either: librosa's audioread fallback is the last try
        pass
    try:
        import librosa

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # librosa warns before falling back to audioread
            data, rate = librosa.load(str(path), sr=None, mono=True, duration=keep)
        return data, int(rate)
    except Exception as e:
        reason = str(first).strip() or type(first).__name__
        raise MediaError(f"cannot read audio file {path}: {reason}") from e


def _decode_with_av(path: Path, max_seconds: float | None = None) -> np.ndarray:
    """Decode any container/codec FFmpeg knows (through PyAV, which bundles it) to mono 16 kHz,
    stopping after ``max_seconds``."""
    import av

    chunks, total = [], 0
    limit = None if max_seconds is None else int(max_seconds * SAMPLING_RATE)
    with av.open(str(path)) as container:
        if not container.streams.audio:
            raise MediaError(f"{path} has no audio stream")
        resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLING_RATE)
        for frame in container.decode(container.streams.audio[0]):
            resampled = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
            chunks += resampled
            total += sum(len(c) for c in resampled)
            if limit is not None and total >= limit:
                break
        else:
            chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    if not chunks:
        raise MediaError(f"{path} holds no audio samples")
    return np.concatenate(chunks).astype(np.float32)


class AudioFeatureExtractor:
    """transformers' ``Gemma4AudioFeatureExtractor`` in numpy, plus the processor's soft-token count.

    Returns, for a batch padded to its longest clip (rounded up to 128 samples): ``input_features``
    [N, T, 128] float32 log-mel (zero on padding frames), ``input_features_mask`` [N, T] bool (a
    frame is valid only if its whole window is real audio), and ``num_soft_tokens`` per clip.
    """

    def __init__(
        self,
        feature_size: int = 128,
        sampling_rate: int = SAMPLING_RATE,
        padding_value: float = 0.0,
        frame_length_ms: float = 20.0,
        hop_length_ms: float = 10.0,
        min_frequency: float = 0.0,
        max_frequency: float = 8000.0,
        preemphasis: float = 0.0,
        preemphasis_htk_flavor: bool = True,
        fft_overdrive: bool = False,
        dither: float = 0.0,
        input_scale_factor: float = 1.0,
        mel_floor: float = 1e-3,
        per_bin_mean: Sequence[float] | None = None,
        per_bin_stddev: Sequence[float] | None = None,
        max_length: int | None = MAX_SAMPLES,
        pad_to_multiple_of: int | None = 128,
        audio_seq_length: int = AUDIO_SEQ_LENGTH,
    ):
        import librosa

        self.feature_size = feature_size
        self.sampling_rate = sampling_rate
        self.padding_value = padding_value
        self.preemphasis = preemphasis
        self.preemphasis_htk_flavor = preemphasis_htk_flavor
        self.dither = dither
        self.input_scale_factor = input_scale_factor
        self.mel_floor = np.float64(mel_floor)
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.audio_seq_length = audio_seq_length
        self.frame_length = int(round(sampling_rate * frame_length_ms / 1000.0))
        self.hop_length = int(round(sampling_rate * hop_length_ms / 1000.0))
        self.fft_length = 2 ** math.ceil(math.log2(self.frame_length)) * (2 if fft_overdrive else 1)
        self.window = librosa.filters.get_window("hann", self.frame_length, fftbins=True).astype(np.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the top filters are empty at 257 bins; transformers hides this too
            mel = librosa.filters.mel(
                sr=sampling_rate, n_fft=self.fft_length, n_mels=feature_size, fmin=min_frequency,
                fmax=max_frequency, htk=True, norm=None, dtype=np.float64,
            )
        self.mel_filters = np.ascontiguousarray(mel.T)  # [fft_length // 2 + 1, feature_size], float64
        self.per_bin_mean = None if per_bin_mean is None else np.asarray(per_bin_mean, np.float64).reshape(1, 1, -1)
        self.per_bin_stddev = None if per_bin_stddev is None else np.asarray(per_bin_stddev, np.float64).reshape(1, 1, -1)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "AudioFeatureExtractor":
        """Settings from a checkpoint folder: the ``feature_extractor`` block of
        ``processor_config.json`` (or ``preprocessor_config.json``), defaults for whatever is absent."""
        folder = Path(folder)
        fe: dict[str, Any] = {}
        top: dict[str, Any] = {}
        for name in ("processor_config.json", "preprocessor_config.json", "feature_extractor_config.json"):
            path = folder / name
            if not path.is_file():
                continue
            raw = read_json_object(path, "a processor config")
            top = {**raw, **top}
            block = raw.get("feature_extractor")
            if isinstance(block, dict):
                fe = {**block, **fe}
            elif "Audio" in str(raw.get("feature_extractor_type", "")):
                fe = {**raw, **fe}
        known = set(inspect.signature(cls).parameters)
        kwargs = {k: v for k, v in fe.items() if k in known and k != "audio_seq_length"}
        if "audio_seq_length" in top:
            kwargs["audio_seq_length"] = int(top["audio_seq_length"])
        return cls(**kwargs)

    # ----------------------------------------------------------------- features
    def __call__(self, audios, sampling_rate: int | None = None) -> dict[str, Any]:
        """Features for one clip or a list of clips (arrays or file paths; see :func:`load_audio`).

        As in transformers, a 2-D array is a batch of clips, one per row.
        """
        if isinstance(audios, (str, Path)) or (isinstance(audios, np.ndarray) and audios.ndim == 1):
            audios = [audios]
        elif isinstance(audios, (list, tuple)) and audios and isinstance(audios[0], (int, float, np.number)):
            audios = [np.asarray(audios)]
        if len(audios) == 0:
            raise MediaError("no audio clips given")
        seconds = None if self.max_length is None else self.max_length / SAMPLING_RATE
        clips = [load_audio(a, sampling_rate, max_seconds=seconds) for a in audios]
        for i, c in enumerate(clips, start=1):
            if len(c) < self.min_samples:
                ms = lambda n: f"{n / SAMPLING_RATE * 1000:.1f} ms"  # noqa: E731
                raise MediaError(
                    f"audio clip {i} is too short: {len(c)} samples ({ms(len(c))}) at 16 kHz; one audio token "
                    f"needs at least {self.min_samples} samples ({ms(self.min_samples)})"
                )

        limit = self.max_length
        if limit is not None and self.pad_to_multiple_of:
            limit = -(-limit // self.pad_to_multiple_of) * self.pad_to_multiple_of
        clips = [c[:limit] if limit is not None else c for c in clips]
        length = max(len(c) for c in clips)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        waves = np.full((len(clips), length), self.padding_value, dtype=np.float32)
        real = np.zeros((len(clips), length), dtype=np.int32)
        for i, c in enumerate(clips):
            waves[i, : len(c)] = c
            real[i, : len(c)] = 1

        features, mask = self._extract(waves, real)
        return {
            "input_features": features,
            "input_features_mask": mask,
            "num_soft_tokens": [self.soft_tokens(m) for m in mask],
        }

    def _extract(self, waves: np.ndarray, real: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.dither > 0.0:
            waves = waves + self.dither * np.random.randn(*waves.shape).astype(waves.dtype)
        if self.input_scale_factor != 1.0:
            waves = waves * self.input_scale_factor
        # Semicausal framing: frame_length // 2 zeros in front centre the first frame on t=0.
        pad = self.frame_length // 2
        waves = np.pad(waves, ((0, 0), (pad, 0)))
        real = np.pad(real, ((0, 0), (pad, 0)))
        size = self.frame_length + 1  # one extra sample, for the preemphasis of the first one
        frames = np.lib.stride_tricks.sliding_window_view(waves, size, axis=-1)[:, :: self.hop_length]
        if self.preemphasis > 0.0:
            if self.preemphasis_htk_flavor:
                frames = np.concatenate(
                    [frames[..., :1] * (1.0 - self.preemphasis), frames[..., 1:-1] - self.preemphasis * frames[..., :-2]],
                    axis=-1,
                )
            else:
                frames = frames[..., 1:] - self.preemphasis * frames[..., :-1]
        else:
            frames = frames[..., :-1]
        # float32 frames -> complex64 rFFT -> float64 mel -> float32, exactly transformers' dtypes.
        spectrum = np.abs(np.fft.rfft(frames * self.window, n=self.fft_length, axis=-1))
        log_mel = np.log(np.matmul(spectrum, self.mel_filters) + self.mel_floor)
        if self.per_bin_mean is not None:
            log_mel = log_mel - self.per_bin_mean
        if self.per_bin_stddev is not None:
            log_mel = log_mel / self.per_bin_stddev
        n_frames = frames.shape[1]
        # A frame is valid only when the last sample of its window is real audio.
        mask = real[:, np.arange(n_frames) * self.hop_length + size - 1].astype(bool)
        return log_mel.astype(np.float32) * mask[..., None], mask

    @property
    def min_samples(self) -> int:
        """The shortest clip that gives an audio token: its first frame (after the semicausal
        padding) must end on a real sample. Shorter clips give none, or no frame at all."""
        return self.frame_length + 1 - self.frame_length // 2

    def soft_tokens(self, frame_mask: np.ndarray) -> int:
        """Soft tokens of one clip: valid frames left after the tower's two stride-2 convolutions
        (each keeps every other frame's validity), capped at ``audio_seq_length``."""
        return min(int(np.asarray(frame_mask)[::2][::2].sum()), self.audio_seq_length)
