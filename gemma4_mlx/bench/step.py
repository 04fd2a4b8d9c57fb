"""Benchmark: one decode step, counted. Kernels per step, Python graph-build time, host syncs, and
decode speed with the PLE table mapped or loaded, side by side with mlx-lm in one run.

    python -m gemma4_mlx.bench --step                      # all four variants, real shapes, 4-bit
    python -m gemma4_mlx.bench --step --variants e2b --narrow

Host syncs per step: the sampled token read by the loop (every loop has that one), plus one when
building the step needs its token on the host first (the PLE table read from the file with pread).

How kernels are counted (the same on any machine, so the counts are stable and testable): the step's
lazy graph is built (``model(token, cache)`` with ``cached`` tokens in the cache), written out with
``mx.export_to_dot`` and its primitives counted as a GPU would launch them. Views (reshape of
contiguous data, transpose, slice, broadcast, expand/squeeze, split) launch nothing; a reshape of a
transposed array is one copy; a concatenation launches one copy per input; a compiled function is
one kernel per fused segment (what ``mx.compile`` leaves in the graph); everything else is one.
MLX's fused ops (RMSNorm, LayerNorm, RoPE, attention) are one kernel each on Metal and CUDA, but on
a CPU MLX builds them from their compositions, so while counting they are replaced by stand-ins that
keep their inputs and count one.
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from ..models.text import materialize as evaluate_module
from .speed import narrow

# Primitives that only make a view: no kernel on a GPU.
VIEWS = {"Broadcast", "Reshape", "Flatten", "Unflatten", "ExpandDims", "Squeeze", "Slice", "Transpose", "AsStrided",
         "Split", "StopGradient", "Depends", "View"}  # fmt: skip
# Scans (which no Gemma 4 step uses and which mx.compile cannot fuse) stand in for the fused ops
# while counting; see fast_ops_counted.
_STAND_INS = {"CumSum": "RMSNorm", "CumProd": "RoPE", "CumMax": "ScaledDotProductAttention", "CumMin": "LayerNorm",
              "CumLogAddExp": "Dequantize"}  # fmt: skip


@contextmanager
def fast_ops_counted():
    """Replace MLX's fused ops by one-primitive stand-ins of the same shape and dtype that depend on
    all their inputs, so a CPU graph counts them as a GPU runs them: one kernel each. The values are
    wrong: graphs built inside are for counting, never for evaluating (compiled traces made inside
    are dropped on the way out)."""
    from .. import ops

    names = ("rms_norm", "layer_norm", "rope", "scaled_dot_product_attention")
    saved = {n: getattr(mx.fast, n) for n in names}
    saved_dequantize = mx.dequantize

    def on(x, *deps):
        """``x``, made to depend on ``deps``: two stand-ins differ when their inputs do (else
        mx.compile would merge them as one computation)."""
        deps = [d for d in deps if isinstance(d, mx.array)]
        return mx.depends(x, deps) if deps else x

    def rms_norm(x, weight, eps, **_):
        return mx.cumsum(on(x, weight), axis=-1)

    def layer_norm(x, weight, bias, eps, **_):
        return mx.cummin(on(x, weight, bias), axis=-1)

    def rope(x, dims, *, traditional=False, base=None, scale=1.0, offset=0, freqs=None, **_):
        return mx.cumprod(on(x, offset, freqs), axis=-1)

    def sdpa(q, k, v, *, scale, mask=None, sinks=None, **_):
        out = q if q.shape[-1] == v.shape[-1] else mx.broadcast_to(q[..., :1], (*q.shape[:-1], v.shape[-1]))
        return mx.cummax(on(out, k, v, mask, sinks), axis=-1)

    def dequantize(w, scales, biases=None, group_size=64, bits=4, mode="affine", **_):
        out = mx.broadcast_to(scales[..., :1], (*w.shape[:-1], w.shape[-1] * 32 // bits))
        return mx.logcumsumexp(on(out, w, biases), axis=-1)

    mx.fast.rms_norm, mx.fast.layer_norm, mx.fast.rope, mx.fast.scaled_dot_product_attention = rms_norm, layer_norm, rope, sdpa
    mx.dequantize = dequantize
    ops.invalidate_compiled()
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(mx.fast, name, fn)
        mx.dequantize = saved_dequantize
        ops.invalidate_compiled()


_NODE = re.compile(r'^\{ (\d+) \[label ="([^"]+)"')
_EDGE = re.compile(r'^"?([^"\s]+)"? -> "?([^"\s]+)"?$')


def count_kernels(outputs, one_token: bool = True) -> Counter:
    """Kernels a GPU launches to evaluate ``outputs`` (already-evaluated arrays are inputs), by kind.
    With ``one_token`` (a decode step) a reshape of a transposed array is a view: with one token the
    transposed [B, H, 1, D] is still contiguous."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(path), *outputs)
        lines = path.read_text().splitlines()
    label, inputs, producer = {}, {}, {}
    for line in lines:
        line = line.strip()
        m = _NODE.match(line)
        if m:
            label[m.group(1)] = m.group(2)
            continue
        m = _EDGE.match(line)
        if m:
            a, b = m.groups()
            if b in label:  # array -> primitive
                inputs.setdefault(b, []).append(a)
            elif a in label:  # primitive -> array
                producer[b] = a
    kinds = Counter()
    for node, name in label.items():
        if name in VIEWS:
            if not one_token and name in ("Reshape", "Flatten") and any(label.get(producer.get(a)) == "Transpose" for a in inputs.get(node, [])):
                kinds["Copy"] += 1  # a transposed array is copied to be reshaped
            continue
        if name == "Concatenate":
            kinds[name] += len(inputs.get(node, []))
        elif name.startswith("Compiled"):
            kinds["Compiled"] += 1
        else:
            kinds[_STAND_INS.get(name, name)] += 1
    return kinds


def materialize(*models) -> None:
    """Evaluate every array the models hold, private ones too (RoPE tables): they are inputs of a
    step, not part of it."""
    for model in models:
        evaluate_module(model)


def cache_holding(model, n: int, dtype=mx.bfloat16) -> list:
    """``model.make_cache()`` (ours or mlx-lm's) as if ``n`` tokens had been prefilled (zeros)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from ..models.cache import ValueOnlyKVCache

    cache = model.make_cache()
    text = getattr(model, "text_config", None) or model.args
    layers = [i for i in range(text.num_hidden_layers) if i < text.num_hidden_layers - (text.num_kv_shared_layers or 0)]
    for c, i in zip(cache, layers):
        full = text.layer_types[i] == "full_attention"
        heads = (text.num_global_key_value_heads or text.num_key_value_heads) if full and text.attention_k_eq_v else text.num_key_value_heads
        dim = text.global_head_dim if full else text.head_dim
        if isinstance(c, RotatingKVCache):
            size = min(n, c.max_size)
            c.keys = mx.zeros((1, heads, size, dim), dtype)
            c.values = mx.zeros((1, heads, size, dim), dtype)
            c.offset, c._idx = n, size if n >= c.max_size else n
        elif isinstance(c, ValueOnlyKVCache):
            c.buffers = [mx.zeros((1, heads, (n + c.step - 1) // c.step * c.step, dim), dtype)]
            c.offset = n
        elif isinstance(c, KVCache):
            size = (n + c.step - 1) // c.step * c.step
            c.keys = mx.zeros((1, heads, size, dim), dtype)
            c.values = mx.zeros((1, heads, size, dim), dtype)
            c.offset = n
    mx.eval([stored_arrays(c) for c in cache])
    return cache


def stored_arrays(c) -> list:
    """The arrays a layer's cache stores (a K=V layer's ValueOnlyKVCache: its values alone)."""
    buffers = getattr(c, "buffers", None)
    return list(buffers) if buffers is not None else [c.keys, c.values]


def _copy(cache: list) -> list:
    """Caches that share the arrays of ``cache`` (arrays are immutable: a step on the copy leaves ``cache`` as it is)."""
    out = []
    for c in cache:
        d = type(c).__new__(type(c))
        d.__dict__.update(c.__dict__)
        out.append(d)
    return out


def step_graph(model, cache: list, token: mx.array, ours: bool) -> mx.array:
    """Build (do not run) one decode step: logits for ``token`` [1, 1], caches advanced."""
    if ours:
        return model.forward(token, cache)
    return model(token, cache=cache)


def kernels_per_step(model, cache: list, ours: bool, token: int = 5, tokens: int = 1) -> Counter:
    """Kernels of one decode step of ``model`` over ``cache`` (see the module docstring), or of a
    prefill chunk of ``tokens`` tokens."""
    with fast_ops_counted():
        c = _copy(cache)
        logits = step_graph(model, c, mx.array([[token] * tokens]), ours)
        state = [x for layer in c for x in stored_arrays(layer)]
        return count_kernels([logits, *state], one_token=tokens == 1)


def build_time_ms(pairs: list, cache_of: dict, repeats: int = 15) -> dict[str, float]:
    """Median Python time to build one decode step's graph, each model measured alternately."""
    times = {name: [] for name, _, _ in pairs}
    token = mx.array([[5]])
    for _ in range(repeats):
        for name, model, ours in pairs:
            c = _copy(cache_of[name])
            gc.disable()
            tic = time.perf_counter()
            step_graph(model, c, token, ours)
            times[name].append((time.perf_counter() - tic) * 1e3)
            gc.enable()
    return {name: statistics.median(t) for name, t in times.items()}


def host_needed_before_building(model) -> bool:
    """True if building a decode step needs its token on the host first (a sync that stops the
    loop from building the next step while the device computes the current one)."""
    cache = model.make_cache()
    mx.eval(model.forward(mx.array([[1, 2, 3]]), cache))
    token = mx.array([[4]]) + 1  # lazy until something evaluates it
    model.forward(token, cache)
    return not count_kernels([token])  # an evaluated array has no graph left


def decode_mapped_vs_loaded(variant: str, bits: int, narrow_widths: bool, vocab: int, tokens: int, repeats: int = 3) -> dict:
    """Decode tokens/s of one checkpoint loaded with its PLE table mapped and fully loaded, run
    alternately (best of ``repeats``), and whether each needs the host before building a step."""
    from mlx_lm.sample_utils import make_sampler

    from ..generation.decode import generate_tokens
    from ..loading import load
    from ..variants import variant_config
    from .memory import write_checkpoint

    text = variant_config(variant, None, vocab)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_checkpoint(Path(tmp) / variant, bits=bits, text=narrow(text) if narrow_widths else text, progress=lambda *_: None)
        models = {"mapped": load(folder)[0], "loaded": load(folder, lazy_ple=False)[0]}
        prompt = mx.random.randint(0, vocab, (32,), key=mx.random.key(0))
        speed = {k: 0.0 for k in models}
        for _ in range(repeats):
            for kind, model in models.items():
                steps = generate_tokens(model, prompt, model.make_cache(), tokens + 1, make_sampler(0.0))
                next(steps)  # prefill and the first token
                tic = time.perf_counter()
                n = sum(1 for _ in steps)
                speed[kind] = max(speed[kind], n / (time.perf_counter() - tic))
        syncs = {kind: host_needed_before_building(m) for kind, m in models.items()}
        del models
    return {"tps": speed, "host_first": syncs}


def main(argv: list[str] | None = None) -> list[dict]:
    from ..variants import VARIANTS
    from .speed import build_pair

    p = argparse.ArgumentParser(prog="python -m gemma4_mlx.bench --step", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--bits", type=int, default=4, help="quantization bits (0: bf16)")
    p.add_argument("--cached", type=int, default=1102, help="tokens in the cache before the step")
    p.add_argument("--chunk", type=int, default=512, help="tokens of the prefill chunk whose kernels are counted")
    p.add_argument("--narrow", action="store_true", help="small widths, same layers: the same counts, quicker")
    p.add_argument("--vocab", type=int, default=262_144)
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per run, PLE table mapped vs loaded (E2B/E4B)")
    args = p.parse_args(argv)

    print(f"device: {mx.default_device()}, mlx {mx.__version__}, {f'{args.bits}-bit' if args.bits else 'bf16'}, "
          f"{args.cached} cached tokens{', narrow widths' if args.narrow else ', real shapes'}")  # fmt: skip
    print(HEADER)
    rows = []
    for name in args.variants:
        ours, theirs, text = build_pair(name, None, args.bits or None, vocab_size=args.vocab, edit=narrow if args.narrow else None)
        materialize(ours, theirs)
        caches = {"ours": cache_holding(ours, args.cached), "mlx_lm": cache_holding(theirs, args.cached)}
        k_ours = kernels_per_step(ours, caches["ours"], True)
        k_theirs = kernels_per_step(theirs, caches["mlx_lm"], False)
        chunk = {
            "ours": sum(kernels_per_step(ours, caches["ours"], True, tokens=args.chunk).values()),
            "mlx_lm": sum(kernels_per_step(theirs, caches["mlx_lm"], False, tokens=args.chunk).values()),
        }
        build = build_time_ms([("ours", ours, True), ("mlx_lm", theirs, False)], caches)
        rows.append(dict(variant=name, layers=text["num_hidden_layers"], kernels=(k_ours, k_theirs), chunk=chunk, build_ms=build))
        print(_row(rows[-1]), flush=True)
        del ours, theirs, caches
        gc.collect()
        mx.clear_cache()
    ple_variants = [n for n in args.variants if VARIANTS[n].get("hidden_size_per_layer_input")]
    if ple_variants and args.decode_tokens:
        print(PLE_HEADER)
        for name in ple_variants:
            r = decode_mapped_vs_loaded(name, args.bits or 4, args.narrow, args.vocab, args.decode_tokens)
            rows.append(dict(variant=name, ple=r))
            t, first = r["tps"], r["host_first"]
            print(
                f"| {name} | {t['mapped']:.2f} / {t['loaded']:.2f} / {t['mapped'] / t['loaded']:.2f}x "
                f"| {1 + first['mapped']} / {1 + first['loaded']} |",
                flush=True,
            )
    return rows


PLE_HEADER = (
    "\n| variant | decode tok/s, PLE table mapped / loaded / ratio | host syncs per step, mapped / loaded |\n|---|---|---|"
)

HEADER = (
    "| variant | layers | kernels per decode step (ours / mlx-lm / ratio) | per prefill chunk (ours / mlx-lm / ratio) "
    "| graph build ms per step (ours / mlx-lm / ratio) | our decode kernels by kind |\n|---|---|---|---|---|---|"
)


def _row(r: dict) -> str:
    a, b = r["kernels"]
    ta, tb = r["build_ms"]["ours"], r["build_ms"]["mlx_lm"]
    kinds = ", ".join(f"{k} {n}" for k, n in a.most_common(8))
    ca, cb = r["chunk"]["ours"], r["chunk"]["mlx_lm"]
    return (
        f"| {r['variant']} | {r['layers']} | {sum(a.values())} / {sum(b.values())} / {sum(a.values()) / sum(b.values()):.2f}x "
        f"| {ca} / {cb} / {ca / cb:.2f}x | {ta:.1f} / {tb:.1f} / {ta / tb:.2f}x | {kinds} |"
    )


if __name__ == "__main__":
    main()
