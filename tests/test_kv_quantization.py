"""Quantized KV caches (kv_bits=8/4): full and sliding layers (ring buffers wrapped), chunked prefill
and decoding, prefix reuse, speculative trimming, the memory they hold, and the options."""

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache
from mlx_lm.sample_utils import make_sampler

import gemma4_mlx
from gemma4_mlx import memory
from gemma4_mlx.errors import OptionError
from gemma4_mlx.generation.chat import ChatEngine
from gemma4_mlx.generation.decode import generate_tokens
from gemma4_mlx.generation.speculative import SpeculativeStats, speculative_tokens
from gemma4_mlx.models.cache import QuantizedRotatingKVCache, ValueOnlyKVCache
from gemma4_mlx.ops import reference

GROUP = 32  # the tiny models' heads are 32 and 64 wide
PROMPT = mx.array(np.random.default_rng(0).integers(2, 500, 300))


class Rounded:
    """An unquantized layer cache that stores ``fn(keys)``, ``fn(values)``: the values a quantized
    cache holds, dequantized (or rounded to bf16), kept in the exact cache classes."""

    def __init__(self, inner, fn):
        self.inner, self.fn = inner, fn

    def update_and_fetch(self, keys, values):
        return self.inner.update_and_fetch(self.fn(keys), self.fn(values))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def dequantized(bits):
    return lambda x: mx.dequantize(*mx.quantize(x, group_size=GROUP, bits=bits), group_size=GROUP, bits=bits)


def bf16(x):
    return x.astype(mx.bfloat16).astype(x.dtype)


def chunked_logits(model, cache, ids=PROMPT, chunk=64, decoded=20):
    """Logits of ``ids`` run in chunks, then its last ``decoded`` tokens one at a time."""
    split = ids.size - decoded
    outs = [model(ids[None, s : min(s + chunk, split)], cache=cache) for s in range(0, split, chunk)]
    outs += [model(ids[None, s : s + 1], cache=cache) for s in range(split, ids.size)]
    return mx.concatenate(outs, axis=1)


def rel(a, b):
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_caches_compute_attention_over_the_dequantized_values(family, bits):
    """Chunked prefill (every chunk wraps the 8/16-token windows) then single-token steps: the
    quantized caches give the logits of exact caches holding the dequantized keys and values
    (fp32, < 1e-5): the rings, masks and quantized attention lose nothing beyond the rounding.
    (K=V layers store their values alone, quantized, and make the keys from them.)"""
    model = family.model
    cache = model.make_cache(kv_bits=bits, kv_group_size=GROUP)
    full = ValueOnlyKVCache if model.text_config.attention_k_eq_v else QuantizedKVCache
    assert {type(c) for c in cache} == {full, QuantizedRotatingKVCache}
    assert {c.bits for c in cache} == {bits}
    got = chunked_logits(model, cache)
    want = chunked_logits(model, [Rounded(c, dequantized(bits)) for c in model.make_cache()])
    assert rel(got, want) < 1e-5


def test_quantization_error_is_bounded_by_the_models_sensitivity(family):
    """These random tiny models amplify any change of K/V (rounding them to bf16 alone moves the
    logits by 1-60%), so the bound is relative: measured at seed 0, 8 bits moves the logits 1.6-3x
    as much as bf16 rounding does, 4 bits 2-45x; the test allows 6x and 60x."""
    model = family.model
    exact = chunked_logits(model, model.make_cache())
    rounding = rel(chunked_logits(model, [Rounded(c, bf16) for c in model.make_cache()]), exact)
    for bits, allowed in ((8, 6), (4, 60)):
        err = rel(chunked_logits(model, model.make_cache(kv_bits=bits, kv_group_size=GROUP)), exact)
        assert err < allowed * rounding, (bits, err, rounding)


@pytest.mark.parametrize("bits,group,bound", [(8, 64, 0.02), (4, 64, 0.3), (8, 32, 0.02), (4, 32, 0.25)])
def test_attention_error_on_normed_keys_and_values(bits, group, bound):
    """One attention over 4096 keys as Gemma 4 makes them (unit-RMS K and V, 512 wide, GQA 8:1):
    the quantized cache's output is within ``bound`` of the exact one (relative L2; measured: 8 bits
    1.3-1.4%, 4 bits 21-24%: 4-bit keys and values are lossy, for when memory matters most)."""
    D = 512
    k, v = (mx.fast.rms_norm(mx.random.normal((1, 4, 4096, D), key=mx.random.key(s)), None, 1e-6) for s in (1, 2))
    q = mx.fast.rms_norm(mx.random.normal((1, 32, 8, D), key=mx.random.key(3)), None, 1e-6) * 0.2
    exact = reference.attention(q, k, v, 1.0, "causal")
    got = reference.attention(q, mx.quantize(k, group_size=group, bits=bits), mx.quantize(v, group_size=group, bits=bits), 1.0, "causal")
    assert (mx.linalg.norm((got - exact).flatten()) / mx.linalg.norm(exact.flatten())).item() < bound


@pytest.mark.parametrize("bits", [8, 4])
def test_long_chunks_of_quantized_attention_go_blockwise(monkeypatch, bits):
    """Past the scores budget the quantized attention runs in query blocks, with the same result."""
    from gemma4_mlx.ops import blockwise

    q = mx.random.normal((1, 8, 64, 64), key=mx.random.key(0))
    k, v = (mx.quantize(mx.random.normal((1, 2, 200, 64), key=mx.random.key(s)), group_size=GROUP, bits=bits) for s in (1, 2))
    direct = reference.attention(q, k, v, 0.125, "causal")
    monkeypatch.setattr(blockwise, "SCORES_BUDGET", 8 * 200 * 4 * 5)  # five queries per block
    calls = []
    monkeypatch.setattr(reference, "quantized_attention", lambda *a, **kw: calls.append(1) or reference.quantized_scaled_dot_product_attention(*a, **kw, group_size=GROUP, bits=bits))
    assert rel(reference.attention(q, k, v, 0.125, "causal"), direct) < 1e-5 and len(calls) == 13


def test_prefix_reuse_with_a_quantized_cache_gives_fresh_replies(family):
    """A conversation with an 8-bit cache replies the same with prefix reuse as from a fresh
    cache every turn; switching kv_bits mid-conversation starts a fresh cache."""
    model, processor = family.model, family.processor
    turns = ["hello model, tell me about the water", "and what about the people", "why"]

    def converse(reuse, kv_bits):
        engine, messages, replies, stats = ChatEngine(model, processor), [], [], []
        for turn, bits in zip(turns, kv_bits):
            messages.append({"role": "user", "content": turn})
            last = list(engine.stream(messages, max_tokens=6, reuse=reuse, kv_bits=bits, kv_group_size=GROUP))[-1]
            replies.append(last.reply.content)
            stats.append(last.stats)
            messages.append(last.reply.as_message())
        return replies, stats, engine

    reused, stats, engine = converse(True, [8, 8, 8])
    fresh, _, _ = converse(False, [8, 8, 8])
    assert reused == fresh and all(s.reused_tokens > 0 for s in stats[1:])
    assert isinstance(engine.prompt_cache.cache[0], (QuantizedKVCache, QuantizedRotatingKVCache))
    _, switched, engine = converse(True, [8, 8, None])
    assert switched[1].reused_tokens > 0 and switched[2].reused_tokens == 0
    assert not isinstance(engine.prompt_cache.cache[0], (QuantizedKVCache, QuantizedRotatingKVCache))


def test_speculative_decoding_over_a_quantized_cache_equals_plain(e2b, tmp_path):
    """Verify steps that reject drafts trim the quantized rings; the drafter attends over the
    target's quantized K/V. Greedy tokens equal plain decoding with the same quantized cache."""
    from test_speculative import Oracle, _drafter

    model = e2b.model
    prompt = PROMPT[:40]
    n = 30
    plain = [t for t, _ in generate_tokens(model, prompt, model.make_cache(kv_bits=8, kv_group_size=GROUP), n, make_sampler(0.0))]
    oracle = Oracle(plain, prompt.size, {3, 4, 9, 17, 18}, model.text_config.vocab_size, {"sliding_attention", "full_attention"})
    _, drafter = _drafter(True, tmp_path)
    for d in (oracle, drafter):
        cache = model.make_cache(sliding_slack=1, kv_bits=8, kv_group_size=GROUP)
        stats = SpeculativeStats()
        spec = [t for t, _ in speculative_tokens(model, d, prompt, cache, n, make_sampler(0.0), num_draft_tokens=3, stats=stats)]
        assert spec == plain and stats.drafted > 0


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_bytes_are_exact(family, bits):
    """The memory estimate's KV bytes equal what the quantized caches hold (packed values, scales
    and biases) after a chunked prefill and decoding past the windows."""
    model = family.model
    cache = model.make_cache(kv_bits=bits, kv_group_size=GROUP)
    for _ in generate_tokens(model, PROMPT, cache, 4, make_sampler(0.0), prefill_step_size=128):
        pass
    held = sum(c.nbytes for c in cache)
    expected = memory.kv_cache_bytes(model.text_config, cache[0].offset, 4, prefill_step_size=128, kv_bits=bits, kv_group_size=GROUP)
    assert held == expected
    exact = memory.kv_cache_bytes(model.text_config, cache[0].offset, 4, prefill_step_size=128)
    # fp32 model, groups of 32: 8 bits is 0.31x, 4 bits 0.19x (bf16 and groups of 64: 0.53x, 0.28x)
    assert held / exact == pytest.approx((bits / 8 + 2 * 4 / GROUP) / 4, rel=1e-3)


def test_options_and_command_lines(e2b, tmp_path):
    """kv_bits/kv_group_size are checked with the other options; the generate and memory commands
    take --kv-bits."""
    for bad in (dict(kv_bits=7), dict(kv_bits=True), dict(kv_group_size=48)):
        with pytest.raises(OptionError, match="kv_"):
            list(gemma4_mlx.stream_generate(e2b.model, e2b.processor, "hi", **bad))
    with pytest.raises(OptionError, match="kv_group_size 128 does not divide"):
        e2b.model.make_cache(kv_bits=8, kv_group_size=128)
    quantized = gemma4_mlx.generate(e2b.model, e2b.processor, "hello", max_tokens=5, kv_bits=8, kv_group_size=GROUP)
    cache = e2b.model.make_cache(kv_bits=8, kv_group_size=GROUP)
    assert gemma4_mlx.generate(e2b.model, e2b.processor, "hello", max_tokens=5, cache=cache) == quantized
    run = [sys.executable, "-m", "gemma4_mlx", "--model", str(e2b.path), "--prompt", "hello", "--max-tokens", "5", "--quiet", "--raw"]
    out = subprocess.run(run + ["--kv-bits", "8", "--kv-group-size", str(GROUP)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == quantized.strip(), out.stderr
    out = subprocess.run(run + ["--kv-bits", "7"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "kv_bits" in out.stderr
    from gemma4_mlx.variants import published_config
    import json

    (tmp_path / "config.json").write_text(json.dumps(published_config("31b")))
    est = [memory.estimate(tmp_path / "config.json", 262144, kv_bits=b) for b in (None, 8, 4)]
    assert est[0].kv_cache * 0.5 < est[1].kv_cache < est[0].kv_cache * 0.55 and est[2].kv_cache < est[0].kv_cache * 0.3
    printed = subprocess.run([sys.executable, "-m", "gemma4_mlx.memory", "--model", str(tmp_path / "config.json"), "--context", "262144", "--kv-bits", "4", "--memory", "32"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert f"KV cache {est[2].kv_cache / 1e9:.2f} GB" in printed
