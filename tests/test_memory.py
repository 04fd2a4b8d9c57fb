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
    decoding, for every family (KV-shared layers, K=V layers storing one tensor or two, windows,
    growth in steps of 256)."""
    model = family.model
    for prompt_len, generated, step in ((40, 3, 2048), (300, 20, 64), (600, 1, 256)):
        for single in (True, False):
            cache = model.make_cache(single_kv_storage=single)
            prompt = mx.arange(2, 2 + prompt_len) % 500 + 2
            for _ in generate_tokens(model, prompt, cache, generated + 1, make_sampler(0.0), prefill_step_size=step):
                pass
            held = sum(c.nbytes for c in cache)
            expected = memory.kv_cache_bytes(model.text_config, cache[0].offset, 4, prefill_step_size=step, single_kv_storage=single)
            assert held == expected, (prompt_len, step, single)


def test_weights_bytes_from_headers_match_the_loaded_model(e2b):
    """Read from the safetensors headers alone: the loaded model's parameter bytes (the mapped
    per-layer table excluded, as it stays on disk)."""
    config = gemma4_mlx.ModelConfig.from_file(e2b.path / "config.json")
    model = gemma4_mlx.load_model(e2b.path, merge_projections=False)
    loaded = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert memory.weights_bytes(e2b.path, config) == loaded


@pytest.mark.parametrize("variant", ["e4b", "12b", "31b"])
def test_weights_of_a_bare_quantized_config_are_what_the_converter_writes(variant, tmp_path):
    """From a config alone, the weights of a 4-bit model count as ``python -m convert`` writes them
    (bf16 scales, towers in bf16), less the E2B/E4B per-layer table that stays on disk."""
    from convert.sizes import converted_bytes
    from gemma4_mlx.variants import published_config

    config = published_config(variant)
    written = converted_bytes(config, quantize=True, q_bits=4)
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 64, "bits": 4, "mode": "affine"}}))
    assert memory.estimate(tmp_path / "config.json", 4096).weights == written["total"] - written["ple"]


def test_memory_command_on_a_bare_config(tmp_path):
    """No weights needed: the published 31B config at 256K, as the issue computes it (80 KiB per
    token in its 10 full layers: 21.5 GB, plus the sliding windows), halved by storing the K=V
    layers' values alone."""
    from gemma4_mlx.variants import published_config

    (tmp_path / "config.json").write_text(json.dumps(published_config("31b")))
    est = memory.estimate(tmp_path / "config.json", 262144)
    full = 10 * 2 * 4 * 512 * 2 * 262144
    text = gemma4_mlx.ModelConfig.from_file(tmp_path / "config.json").text_config
    assert full <= memory.kv_cache_bytes(text, 262144, single_kv_storage=False) < full * 1.1
    assert full / 2 <= est.kv_cache < full / 2 * 1.1
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


def test_prefill_peak_grows_by_the_kv_cache_alone(family, monkeypatch):
    """Prefill's peak memory at 1024 and 2048 tokens (chunks of 256) differs by what the KV cache
    grows: at most 3x its growth (mlx-lm's cache rule copies a full layer's buffer as it grows
    it; K=V layers store their values alone), with every attention bounded by a small scores budget.
    The same measurement with the budget out of reach (every chunk's scores against every key at
    once, the O(L^2) term) grows many times more, so the bound means something."""
    from gemma4_mlx.ops import blockwise

    def peak_and_kv(n):
        cache = family.model.make_cache()
        ids = mx.arange(n) % 900 + 2
        mx.eval(ids)
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        for start in range(0, n, 256):  # chunks with their logits: every layer's attention runs
            mx.eval(family.model(ids[None, start : start + 256], cache=cache), [c.state for c in cache])
        return mx.get_peak_memory() - before, sum(c.nbytes for c in cache)

    def growth():
        (p1, kv1), (p2, kv2) = peak_and_kv(1024), peak_and_kv(2048)
        return p2 - p1, kv2 - kv1

    monkeypatch.setattr(blockwise, "SCORES_BUDGET", 64 * 1024)
    peak, kv = growth()
    # 3x: usually under 2.5x, but how MLX's allocator reuses its freed buffers depends on what ran
    # before in the process (2.63x seen once in the full suite); the unbounded case is far above.
    assert 0 < peak <= 3 * kv, (peak, kv)
    monkeypatch.setattr(blockwise, "SCORES_BUDGET", 2**40)
    unbounded, _ = growth()
    assert unbounded > 5 * kv, (unbounded, kv)


def test_memory_per_process_of_a_pipeline(e2b, tmp_path):
    """``process_estimates``: the processes' weights add up to the model's plus the embeddings and
    final norm each further process holds; each holds the caches of its layers and of the sources of
    its KV-shared layers; the command prints a line per process."""
    from gemma4_mlx.memory import estimate, kv_cache_bytes, process_estimates
    from gemma4_mlx.memory.__main__ import main

    whole = estimate(e2b.path, 64)
    parts = process_estimates(e2b.path, 64, 2, "6,4")
    assert [layers for layers, _ in parts] == ["layers 0-5", "layers 6-9"]
    lm = e2b.model.language_model
    repeated = lm.embed_tokens.weight.nbytes + lm.norm.weight.nbytes
    assert sum(e.weights for _, e in parts) == whole.weights + repeated
    text = e2b.model.text_config
    assert parts[0][1].kv_cache == whole.kv_cache  # layers 6-9 are KV-shared: every cache is in 0-5
    assert parts[1][1].kv_cache == kv_cache_bytes(text, 64, layers={4, 5}) > 0  # copies of their sources'
    assert main(["--model", str(e2b.path), "--context", "64", "--processes", "3"]) == 0
