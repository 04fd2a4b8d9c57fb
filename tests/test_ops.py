"""The ops seam: every model module goes through gemma4_mlx.ops, a registered implementation is used
on its device (and only there), and GEMMA4_MLX_REFERENCE_OPS=1 forces the reference composition."""

import subprocess
import sys
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from gemma4_mlx import ops
from gemma4_mlx.ops import reference


@pytest.fixture
def registry(monkeypatch):
    """A clean registry for the test (restored after it)."""
    monkeypatch.setattr(ops, "_FAST", {})
    monkeypatch.setattr(ops, "_chosen", {})
    monkeypatch.setattr(ops, "REFERENCE_ONLY", False)
    return ops


def counting(calls: Counter):
    """Implementations that count their calls and compute the reference."""
    return {name: (lambda name: lambda *a: (calls.update([name]), getattr(reference, name)(*a))[1])(name) for name in ops.OPS}


def test_every_op_goes_through_the_seam(registry, family):
    calls = Counter()
    device = mx.default_device().type
    for name, fn in counting(calls).items():
        registry.register(name, device, fn)
    ids = mx.array(np.random.default_rng(0).integers(0, 1024, (1, 12)))
    got = family.model(ids)
    per_layer = family.model.text_config.num_hidden_layers
    assert calls["attention"] == per_layer and calls["add_rms_norm"] >= 2 * per_layer
    assert calls["rope"] >= per_layer and calls["geglu"] >= per_layer and calls["rms_norm"] >= 2 * per_layer
    if family.model.text_config.enable_moe_block:
        assert calls["moe_experts"] == per_layer
    # The reference and the (counting) registered path compute the same logits.
    registry.REFERENCE_ONLY = True
    registry._chosen.clear()
    calls.clear()
    assert mx.array_equal(family.model(ids), got).item() and not calls


def test_an_implementation_serves_only_its_device(registry):
    other = mx.DeviceType.gpu if mx.default_device().type == mx.DeviceType.cpu else mx.DeviceType.cpu
    registry.register("geglu", other, lambda gate, up: gate * 0)
    x = mx.ones((2, 3))
    assert mx.array_equal(registry.geglu(x, x), reference.geglu(x, x)).item()
    with pytest.raises(ValueError, match="no op named 'softmax'"):
        registry.register("softmax", other, lambda x: x)


def test_environment_variable_forces_the_reference():
    code = "import gemma4_mlx.ops as o; print(o.REFERENCE_ONLY)"
    for value, expected in (("1", "True"), ("0", "False"), ("", "False")):
        env = {"GEMMA4_MLX_REFERENCE_OPS": value, "PATH": ""}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == expected, out.stderr


def _direct(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)


@pytest.mark.parametrize("head_dim", [256, 512])
@pytest.mark.parametrize("L", [1, 2, 5, 8, 70])
def test_attention_in_query_blocks_equals_direct(head_dim, L):
    """Causal, sliding window (a mask array, also as a wrapped ring buffer sees it), bidirectional
    image blocks (queries attend forward inside their block), no mask; GQA 4:1; fp32 < 1e-5."""
    from mlx_lm.models.base import create_causal_mask

    from gemma4_mlx.ops.blockwise import attention_in_query_blocks

    S = 96
    q = mx.random.normal((1, 8, L, head_dim), key=mx.random.key(L))
    k = mx.random.normal((1, 2, S, head_dim), key=mx.random.key(100 + L))
    v = mx.random.normal((1, 2, S, head_dim), key=mx.random.key(200 + L))
    sliding = create_causal_mask(L, S - L, window_size=16)
    blocks = np.full(S, -1)
    blocks[S - L // 2 - 3 : S - 1] = 0  # an image block spanning the chunk's middle
    ids = mx.array(blocks)
    image = (mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]) | ((ids[S - L :][:, None] == ids[None]) & (ids[S - L :][:, None] >= 0))
    for mask in (None, "causal", sliding, image[None, None]):
        for block in (1, 3, 7, 64):
            got = attention_in_query_blocks(q, k, v, 0.3, mask, block)
            want = _direct(q, k, v, mask)
            err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
            assert err < 1e-5, (L, block, err)


def test_long_chunks_take_the_blockwise_path_within_the_budget(monkeypatch):
    """ops.attention splits a chunk whose scores exceed the budget, and its peak memory is then
    bounded by the budget: about the same for a chunk 4x longer (no L x S term)."""
    import gemma4_mlx.ops.blockwise as blockwise

    monkeypatch.setattr(blockwise, "SCORES_BUDGET", 2**20)
    calls = []
    original = blockwise.attention_in_query_blocks
    monkeypatch.setattr(blockwise, "attention_in_query_blocks", lambda *a: calls.append(a[5]) or original(*a))
    S = 2048
    k = mx.random.normal((1, 2, S, 64))
    v = mx.random.normal((1, 2, S, 64))
    peaks = []
    for L in (256, 1024):
        q = mx.random.normal((1, 8, L, 64))
        mx.eval(q, k, v)
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        out = ops.attention(q, k, v, 0.125, "causal")
        mx.eval(out)
        peaks.append(mx.get_peak_memory() - base - 2 * out.nbytes)  # the output (and its concatenated blocks)
        assert mx.allclose(out, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"), atol=1e-5)
    assert calls == [16, 16]  # 1 MiB / (8 heads x 2048 keys x 4 bytes)
    direct_scores = 8 * 1024 * S * 4
    assert peaks[1] < 8 * 2**20 < direct_scores and peaks[1] < 1.5 * peaks[0] + 2**20
    mx.eval(ops.attention(q[:, :, :1], k, v, 0.125, None))
    assert calls == [16, 16]  # one query (a decode step) never splits
