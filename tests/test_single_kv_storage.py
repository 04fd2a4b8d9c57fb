"""K=V layers (the 26B/31B full-attention layers) storing their values alone, their keys made from
them when attention reads them: all at once, or in key blocks past the scores budget."""

import mlx.core as mx
import numpy as np
import pytest

from helpers import hf_logits, random_ids, rel_err

from gemma4_mlx.models.cache import ValueOnlyKVCache
from gemma4_mlx.models.text import make_rope
from gemma4_mlx.ops import DerivedKeys, blockwise, reference

SEQ = 40
CHUNKS = [9, 14, 1, 1, 12, 1, 1, 1]  # a chunked prefill, then single steps: SEQ tokens


def chunked_logits(model, cache, ids):
    out, t = [], 0
    for n in CHUNKS:
        out.append(model(mx.array(ids[:, t : t + n].numpy()), cache=cache))
        t += n
    assert t == SEQ
    return mx.concatenate(out, axis=1)


def test_one_stored_tensor_gives_the_logits_of_two(family):
    """The same logits as caching both K and V (bit for bit: the derived keys are the same
    product and rotation), with the K=V layers holding half the bytes. Models without K=V layers
    (E2B/E4B) keep mlx-lm's caches."""
    model = family.model
    ids = random_ids(SEQ, seed=7)
    single, double = model.make_cache(), model.make_cache(single_kv_storage=False)
    assert mx.array_equal(chunked_logits(model, single, ids), chunked_logits(model, double, ids))
    kv_layers = [i for i, c in enumerate(single) if isinstance(c, ValueOnlyKVCache)]
    if not model.text_config.attention_k_eq_v:
        assert kv_layers == []
        return
    assert kv_layers and all(model.text_config.layers[i].k_eq_v for i in kv_layers)
    for i in kv_layers:
        assert 2 * single[i].nbytes == double[i].nbytes


def test_keys_made_in_key_blocks_match_transformers(family, monkeypatch):
    """With a scores budget so small that every K=V layer's attention makes and reads its keys in
    key blocks (prefill chunks and single steps alike), the logits still match transformers."""
    calls = []
    over_blocks = blockwise.attention_over_key_blocks
    monkeypatch.setattr(blockwise, "attention_over_key_blocks", lambda *a: calls.append(a[-1]) or over_blocks(*a))
    monkeypatch.setattr(blockwise, "SCORES_BUDGET", 1024)
    ids = random_ids(SEQ, seed=8)
    got = chunked_logits(family.model, family.model.make_cache(), ids)
    assert rel_err(got, hf_logits(family.hf, ids)) < 1e-4
    k_eq_v_layers = sum(s.k_eq_v for s in family.model.text_config.layers)
    assert len(calls) == k_eq_v_layers * len(CHUNKS)
    assert min(calls, default=0) < SEQ  # several key blocks (where there are K=V layers)


def normed(shape, seed):
    return mx.fast.rms_norm(mx.random.normal(shape, key=mx.random.key(seed)), None, 1e-6)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(512, 8, 1), (256, 4, 2), (64, 4, 4)])
@pytest.mark.parametrize("queries", [1, 3, 8, 70])
@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive"])
def test_key_blocks_equal_the_direct_attention(head_dim, heads, kv_heads, queries, mask):
    """The online softmax over key blocks equals MLX's attention over all the keys at once (fp32,
    < 1e-5), for GQA and plain heads, head dims 512/256, one to many queries and every mask kind,
    at key blocks that do not divide the keys, starting past position 0."""
    S = 100
    values = normed((1, kv_heads, S, head_dim), 1)
    rope = make_rope(head_dim, {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6})
    keys = DerivedKeys(values, 1 + 0.1 * mx.random.normal((head_dim,), key=mx.random.key(2)), rope, head_dim, start=5)
    q = normed((1, heads, queries, head_dim), 3)
    if mask in ("bool", "additive"):
        visible = mx.random.uniform(shape=(1, heads, queries, S), key=mx.random.key(4)) < 0.7
        visible[..., 0] = True  # every query sees a key
        mask = visible if mask == "bool" else mx.where(visible, 0.0, -1e9)
    direct = mx.fast.scaled_dot_product_attention(q, keys.block(), values, scale=0.3, mask=mask)
    for block in (7, 32, S):
        got = blockwise.attention_over_key_blocks(q, keys, values, 0.3, mask, block)
        assert rel_err(got, direct) < 1e-5, block


@pytest.mark.parametrize("bits", [8, 4])
def test_key_blocks_over_quantized_values(bits):
    """Quantized stored values: the keys are made from the dequantized values, the same whether
    all at once (within the budget) or in key blocks."""
    D, S = 256, 90
    values = mx.quantize(normed((1, 2, S, D), 1), group_size=64, bits=bits)
    rope = make_rope(D, {"rope_type": "default", "rope_theta": 1e4})
    keys = DerivedKeys(values, mx.ones((D,)), rope, D)
    q = normed((1, 8, 4, D), 3)
    dense = reference.attention(q, keys, values, 1.0, "causal")
    want = mx.fast.scaled_dot_product_attention(q, keys.block(), mx.dequantize(*values, group_size=64, bits=bits), scale=1.0, mask="causal")
    assert rel_err(dense, want) < 1e-6
    got = blockwise.attention_over_key_blocks(q, keys, values, 1.0, "causal", 16)
    assert rel_err(got, want) < 1e-5


def test_derived_keys_equal_the_keys_a_layer_makes(family):
    """A K=V layer's keys made from its cached values are the keys its projection makes (bit for
    bit), at every position of a chunk after earlier ones."""
    model = family.model
    layer = next((layer for layer in model.language_model.layers if layer.spec.k_eq_v), None)
    if layer is None:
        assert not model.text_config.attention_k_eq_v
        return
    x = mx.random.normal((1, 12, model.text_config.hidden_size), key=mx.random.key(0))
    _, k, v = layer.attention_inputs(x, 30)
    derived = layer.self_attn.keys_from_values(v, start=30)
    assert np.array_equal(np.array(derived.block()), np.array(k))
    assert np.array_equal(np.array(derived.block(5, 9)), np.array(k[:, :, 5:9]))
