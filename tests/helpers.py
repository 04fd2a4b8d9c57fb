"""Test utilities shared across the test files: comparisons, random inputs, media, chat messages."""

from __future__ import annotations

import contextlib
import functools
import socket

import numpy as np
import torch
from PIL import Image

SAMPLING_RATE = 16_000


def as_numpy(x) -> np.ndarray:
    """float64 numpy from an MLX array, a torch tensor or anything numpy takes."""
    if isinstance(x, torch.Tensor):
        return x.detach().float().numpy().astype(np.float64)
    if type(x).__module__.startswith("mlx"):
        import mlx.core as mx

        return np.array(x.astype(mx.float32), dtype=np.float64)
    return np.asarray(x, dtype=np.float64)


def rel_err(ours, ref) -> float:
    """``max |ours - ref| / max |ref|``; the shapes must agree."""
    a, b = as_numpy(ours), as_numpy(ref)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max() / np.abs(b).max())


def random_ids(n: int, seed: int = 0, vocab: int = 1024) -> torch.Tensor:
    """[1, n] random token ids, reproducible."""
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf, ids) -> np.ndarray:
    """transformers' logits for token ids (a torch tensor or anything numpy takes)."""
    ids = ids if isinstance(ids, torch.Tensor) else torch.from_numpy(np.array(ids).astype(np.int64))
    with torch.no_grad():
        return hf(ids).logits.float().numpy()


def tone(seconds: float, freq: float = 440.0, rate: int = SAMPLING_RATE, amp: float = 0.3) -> np.ndarray:
    """A sine clip (float32)."""
    return (amp * np.sin(2 * np.pi * freq * np.arange(int(round(rate * seconds))) / rate)).astype(np.float32)


def random_image(height: int, width: int, seed: int = 0) -> Image.Image:
    """An RGB image of uniform noise."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def messages_with(*items, text: str = "Describe these.") -> list[dict]:
    """One user message: the given content items, then a text."""
    return [{"role": "user", "content": [*items, {"type": "text", "text": text}]}]


def to_torch(inputs: dict) -> dict:
    """Our processor's outputs as transformers' model inputs (with its ``mm_token_type_ids``)."""
    from gemma4_mlx.testing import media_token_ids

    out = {}
    for k, v in inputs.items():
        a = np.array(v)
        out[k] = torch.from_numpy(a.astype(np.int64) if a.dtype.kind in "iu" else a)
    ids, cfg = out["input_ids"], media_token_ids()
    types = torch.zeros_like(ids)
    types[ids == cfg["image_token_id"]] = 1
    types[ids == cfg["video_token_id"]] = 2
    types[ids == cfg["audio_token_id"]] = 3
    out["mm_token_type_ids"] = types
    return out


# ---------------------------------------------------------------------------- the chat app
WEATHER = {"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(holder, port: int | None = None, api=None):
    """Serve the app for ``holder`` (an ``app.backend.ModelHolder``) on localhost, with ``api`` (a
    router from ``app.api.make_router``) beside it; (app, url)."""
    from app.ui import build_app
    from app.ui import launch as launch_app

    app = build_app(holder)
    port = port or free_port()
    launch_app(app, api=api, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    return app, f"http://127.0.0.1:{port}/"


@contextlib.contextmanager
def word_replies(engine, max_tokens: int = 1 << 20):
    """Replies of plain words, ``max_tokens`` long: the sampler picks among word tokens, never an
    end token nor a tool call (the tiny model's random replies can open one, and the next message
    is then a tool's result). Words, not the tiny model's favourite ``<unused24>``: thousands of
    tag-like tokens made the browser slow to render on a loaded machine."""
    import mlx.core as mx

    original = engine.stream
    words = mx.array(sorted(set(engine.processor.encode(" the of and to in is you that it he was for on are as with", add_special_tokens=False))))

    def plain_words(logprobs):
        return words[mx.argmax(logprobs[..., words], axis=-1)]

    def replies(*args, **options):
        return original(*args, **{**options, "sampler": plain_words, "max_tokens": max_tokens})

    engine.stream = replies
    try:
        yield
    finally:
        engine.stream = original


def endless_replies(engine):
    """Replies that only Stop ends: :func:`word_replies` up to the context's end (the engine clamps
    max tokens there). The page asks for 1024, which a fast machine writes in 4 s: a test pressing
    Stop on a loaded one could find the reply already over (the CI failure of
    test_phone_layout_and_send_button_becomes_stop)."""
    return word_replies(engine)


def scripted(engine, text, stream=None):
    """``engine.stream`` (or ``stream``) writing ``text`` token by token, then ending the turn."""
    import mlx.core as mx

    processor = engine.processor
    it = iter(processor.encode(text, add_special_tokens=False))
    end = processor.tokenizer.convert_tokens_to_ids("<turn|>")
    return functools.partial(stream or engine.stream, sampler=lambda logprobs: mx.array([next(it, end)]))
