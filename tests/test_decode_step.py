"""The decode step: what its graph costs (kernels, host syncs), and that the faster path computes
exactly what the plain one does.

Kernel counts come from the step's graph (gemma4_mlx.bench.step explains the counting), so they are
the same on any machine: the budgets below are counts, not times.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

import gemma4_mlx
from gemma4_mlx.bench import step as bench_step
from gemma4_mlx.bench.speed import build_pair, narrow
from gemma4_mlx.generation.decode import generate_tokens
from gemma4_mlx.loading import ple

# Kernels per decode step with every layer of the variant (1102 cached tokens, 4-bit), and
# mlx-lm's count on the same weights, measured by count_kernels. A change that adds kernels to the
# step fails here; one that removes some lowers the budget.
BUDGET = {"e2b": 728, "26b-a4b": 1033, "31b": 1038}
MLX_LM = {"e2b": 827, "26b-a4b": 1267, "31b": 1320}


@pytest.fixture(scope="module", params=sorted(BUDGET))
def pair(request):
    ours, theirs, text = build_pair(request.param, None, 4, vocab_size=1024, edit=narrow)
    bench_step.materialize(ours, theirs)
    return request.param, ours, theirs


def test_kernels_per_decode_step(pair):
    name, ours, theirs = pair
    k_ours = bench_step.kernels_per_step(ours, bench_step.cache_holding(ours, 1102), ours=True)
    k_theirs = bench_step.kernels_per_step(theirs, bench_step.cache_holding(theirs, 1102), ours=False)
    print(name, sum(k_ours.values()), dict(k_ours.most_common()), "mlx-lm", sum(k_theirs.values()))
    assert sum(k_theirs.values()) == MLX_LM[name]  # the counting itself has not drifted
    assert sum(k_ours.values()) <= BUDGET[name]
    # The fused ops count one each, like on a GPU; a step has one attention per layer.
    assert k_ours["ScaledDotProductAttention"] == len(ours.layers)


def test_counting_leaves_the_compiled_step_intact(pair):
    """Counting swaps in stand-ins for MLX's fused ops; the compiled traces made meanwhile are
    dropped, so a real step afterwards computes real values."""
    name, ours, _ = pair
    token = mx.array([[7]])
    cache = bench_step.cache_holding(ours, 40)
    before = ours.forward(token, bench_step._copy(cache))
    bench_step.kernels_per_step(ours, cache, ours=True)
    after = ours.forward(token, bench_step._copy(cache))
    assert mx.array_equal(before, after).item()


def _greedy(model, prompt, n=6):
    tokens, logprobs = [], []
    for t, lp in generate_tokens(model, prompt, model.make_cache(), n, make_sampler(0.0)):
        tokens.append(t)
        logprobs.append(np.array(lp.astype(mx.float32)))
    return tokens, np.stack(logprobs)


def test_compiled_decode_steps_equal_the_plain_path_exactly(pair):
    """Decode steps run each layer as two compiled halves; with compilation off the very same
    Python runs op by op. In bf16, every logit of every step is bit-identical."""
    name, ours, _ = pair
    prompt = mx.random.randint(0, 1024, (12,), key=mx.random.key(1))
    compiled = _greedy(ours, prompt)
    mx.disable_compile()
    try:
        plain = _greedy(ours, prompt)
    finally:
        mx.enable_compile()
    assert compiled[0] == plain[0]
    assert np.array_equal(compiled[1], plain[1])


@pytest.mark.parametrize("name", sorted(BUDGET))
def test_greedy_tokens_equal_mlx_lms(name):
    """In float32 (in bf16 the 26B's router differs: ours computes its softmax in float32, as
    transformers does, mlx-lm's in bf16, and random MoE weights amplify that into other experts)."""
    from mlx_lm.generate import generate_step

    ours, theirs, _ = build_pair(name, None, None, dtype=mx.float32, vocab_size=1024, edit=narrow)

    prompt = mx.random.randint(0, 1024, (12,), key=mx.random.key(2))
    mine = [t for t, _ in generate_tokens(ours, prompt, ours.make_cache(), 8, make_sampler(0.0))]
    theirs_tokens = [int(t) for t, _ in generate_step(prompt, theirs, max_tokens=8)]
    assert mine == theirs_tokens


def _evaluated_while_building(model, token_value: int) -> bool:
    """Build (not run) one decode step on a token that is still a lazy computation; True if building
    it had to evaluate the token: a host sync before the step's graph exists."""
    cache = model.make_cache()
    mx.eval(model.forward(mx.array([[1, 2, 3]]), cache))
    token = mx.array([[token_value - 1]]) + 1  # lazy until something evaluates it
    model.forward(token, cache)
    return not bench_step.count_kernels([token])  # an evaluated array has no graph left


def test_host_syncs_per_decode_step(e2b, monkeypatch):
    """With the PLE table loaded, or mapped where the device gathers from the mapping, building a
    step needs nothing from the host (the loop's one sync is the sampled token, as in mlx-lm). Read
    with pread, the mapped table needs the token first: that is the step's one sync."""
    loaded, _ = gemma4_mlx.load(e2b.path, lazy_ple=False)
    mapped, _ = gemma4_mlx.load(e2b.path)
    assert mapped.language_model.mapped_ple is not None and not mapped.language_model.mapped_ple.on_device
    assert not _evaluated_while_building(loaded, 9)
    assert _evaluated_while_building(mapped, 9)

    # Where host memory can be wrapped (Metal), the mapped table is gathered on the device. Here
    # the wrap copies (this backend cannot wrap), which runs the same code path.
    monkeypatch.setattr(ple, "wrap_host_memory", lambda buffer: mx.array(np.asarray(buffer)))
    on_device, _ = gemma4_mlx.load(e2b.path)
    assert on_device.language_model.mapped_ple.on_device
    assert not _evaluated_while_building(on_device, 9)
    ids = mx.array([[5, 9, 9, 200, 3]])
    expected = loaded.forward(ids)
    for model in (mapped, on_device):
        assert mx.array_equal(model.forward(ids), expected).item()


@pytest.mark.parametrize("name", sorted(BUDGET))
def test_merged_projections_compute_exactly_what_the_separate_ones_do(name):
    """load_model merges q/k/v and gate/up (dense and experts) into one matmul each and folds the
    q/k norm scales behind one unscaled norm. In bf16, 4-bit, the logits are bit-identical to the
    separate projections' for a prefill (12 tokens: the 26B's experts sort their rows), a short
    chunk (3 tokens: unsorted, one row per token) and single-token steps (the compiled path)."""
    ours, _, _ = build_pair(name, None, 4, vocab_size=1024, edit=narrow, merge=False)
    ids = mx.random.randint(0, 1024, (1, 17), key=mx.random.key(4))
    chunks = [ids[:, :12], ids[:, 12:15], ids[:, 15:16], ids[:, 16:]]

    def logits():
        cache = ours.make_cache()
        out = [ours.forward(chunk, cache) for chunk in chunks]
        mx.eval(out)
        return out

    separate = logits()
    ours.merge_projections()
    layer = ours.layers[0]
    assert "qkv_proj" in layer.self_attn and "q_proj" not in layer.self_attn
    assert "gate_up_proj" in layer.mlp
    if layer.has_moe:
        assert "gate_up_proj" in layer.experts.switch_glu
    for a, b in zip(separate, logits()):
        assert mx.array_equal(a, b).item()


def test_projections_of_different_quantization_stay_separate():
    """Rows quantized differently cannot share a matmul: such a layer keeps its projections."""
    import mlx.nn as nn

    from gemma4_mlx.models import merging

    four, eight = nn.QuantizedLinear(64, 32, bits=4), nn.QuantizedLinear(64, 32, bits=8)
    assert merging.can_merge([four, nn.QuantizedLinear(64, 16, bits=4)])
    assert not merging.can_merge([four, eight])
    assert not merging.can_merge([four, nn.Linear(64, 32)])
    assert not merging.can_merge([nn.Linear(64, 32), nn.Linear(32, 32)])
    with pytest.raises(ValueError, match="cannot be merged"):
        merging.merge([four, eight])


def test_step_bench_prints_its_table(capsys):
    """``python -m gemma4_mlx.bench --step`` end to end on one variant (small vocabulary, no decode run)."""
    rows = bench_step.main(["--variants", "e2b", "--narrow", "--vocab", "1024", "--chunk", "8", "--decode-tokens", "0"])
    out = capsys.readouterr().out
    assert "| e2b | 35 |" in out and "per prefill chunk" in out
    (row,) = rows
    assert sum(row["kernels"][0].values()) <= BUDGET["e2b"] and row["chunk"]["ours"] < row["chunk"]["mlx_lm"]
