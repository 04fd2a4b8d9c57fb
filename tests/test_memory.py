"""Knowing the memory a context needs before running it (gemma4_mlx.memory)."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.sample_utils import make_sampler

import gemma4_mlx
from gemma4_mlx import memory
from gemma4_mlx.generation.decode import generate_tokens


def test_kv_cache_bytes_are_exact(family):
    """Past the sliding window, the estimate equals what the caches hold after a chunked prefill and
    decoding, for every family (KV-shared layers, K=V layers, windows, growth in steps of 256)."""
    model = family.model
    for prompt_len, generated, step in ((40, 3, 2048), (300, 20, 64), (600, 1, 256)):
        cache = model.make_cache()
        prompt = mx.arange(2, 2 + prompt_len) % 500 + 2
        for _ in generate_tokens(model, prompt, cache, generated + 1, make_sampler(0.0), prefill_step_size=step):
            pass
        held = sum(c.keys.nbytes + c.values.nbytes for c in cache)
        context = cache[0].offset
        assert held == memory.kv_cache_bytes(model.text_config, context, bytes_per_value=4, prefill_step_size=step), (prompt_len, step)


def test_weights_bytes_from_headers_match_the_loaded_model(e2b):
    """Read from the safetensors headers alone: the loaded model's parameter bytes (the mapped
    per-layer table excluded, as it stays on disk)."""
    config = gemma4_mlx.ModelConfig.from_file(e2b.path / "config.json")
    model = gemma4_mlx.load_model(e2b.path, merge_projections=False)
    loaded = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert memory.weights_bytes(e2b.path, config) == loaded


def test_memory_command_on_a_bare_config(tmp_path):
    """No weights needed: the published 31B config at 256K, as the issue computes it (80 KiB per
    token in its 10 full layers: 21.5 GB, plus the sliding windows)."""
    from gemma4_mlx.variants import published_config

    (tmp_path / "config.json").write_text(json.dumps(published_config("31b")))
    est = memory.estimate(tmp_path / "config.json", 262144)
    full = 10 * 2 * 4 * 512 * 2 * 262144
    assert full <= est.kv_cache < full * 1.1
    out = subprocess.run([sys.executable, "-m", "gemma4_mlx.memory", "--model", str(tmp_path / "config.json"), "--context", "4096", "--memory", "64"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "4096 tokens: weights" in out and "longest context within 64.0 GB" in out
    assert memory.longest_context(tmp_path / "config.json", 1e9) == 0  # not even the weights fit
    assert memory.longest_context(tmp_path / "config.json", 1e15) == 262144  # the 31B's whole context


def test_a_prompt_that_cannot_fit_is_refused_and_the_chat_goes_on(e2b, monkeypatch):
    """With less free memory than the KV cache and workspace need, generation stops before
    touching any cache, with an error that says how much is needed and what would fit; the
    conversation is unchanged and replies once memory allows."""
    messages = [{"role": "user", "content": "Hello there"}]
    expected = gemma4_mlx.generate(e2b.model, e2b.processor, messages, max_tokens=8)
    chat = gemma4_mlx.Chat(e2b.model, e2b.processor)
    assert chat.ask("Hello there", max_tokens=8) == expected
    monkeypatch.setattr(memory, "device_memory", lambda hard=False: mx.get_active_memory() + 1000)
    with pytest.raises(gemma4_mlx.ContextLengthError, match=r"needs about .* GB .* tokens would fit"):
        gemma4_mlx.generate(e2b.model, e2b.processor, messages, max_tokens=8)
    with pytest.raises(gemma4_mlx.ContextLengthError, match="quantized weights"):
        chat.ask("And now?", max_tokens=8)
    assert len(chat.messages) == 2  # the refused turn left no trace
    monkeypatch.undo()
    assert chat.ask("And now?", max_tokens=8) and chat.last_stats.reused_tokens > 0
