"""Benchmark: gemma4-mlx against mlx-lm's own Gemma 4 model, on the same random weights, in one run.

    python -m gemma4_mlx.bench                       # all four variant shapes, 4-bit
    python -m gemma4_mlx.bench --variants e2b 31b --prompt-tokens 512 --gen-tokens 128 --layers full

Each variant is built with its real shapes (hidden size, heads, head dims, vocabulary, experts,
per-layer embeddings); ``--layers`` keeps the real layer pattern but fewer layers, so the benchmark
fits a small machine (the default on a CPU). Both models get the very same weight arrays, run the
same greedy generation, and are timed alternately; the table shows prefill and decode tokens/s,
peak memory and our/mlx-lm ratios. These machines are noisy: read the ratios, and take the best of
``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import FULL, SLIDING, ModelConfig
from .model import Gemma4Model

S, F = SLIDING, FULL

# Published text configs (the parts that shape compute and memory).
VARIANTS = {
    "e2b": dict(
        hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, layer_types=[S, S, S, S, F] * 7,
        num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
        num_kv_shared_layers=20, hidden_size_per_layer_input=256, use_double_wide_mlp=True, sliding_window=512,
    ),
    "e4b": dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, layer_types=([S] * 5 + [F]) * 7,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512,
        num_kv_shared_layers=18, hidden_size_per_layer_input=256, use_double_wide_mlp=True, sliding_window=512,
    ),
    "26b-a4b": dict(
        hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, layer_types=([S] * 5 + [F]) * 5,
        num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256, global_head_dim=512,
        attention_k_eq_v=True, enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
        hidden_size_per_layer_input=0, sliding_window=1024,
    ),
    "31b": dict(
        hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, layer_types=([S] * 5 + [F]) * 10,
        num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4, head_dim=256, global_head_dim=512,
        attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=1024,
    ),
}


def variant_config(name: str, layers: int | None = None, vocab_size: int = 262_144) -> dict:
    """The variant's text config, cut to ``layers`` layers (whole pattern periods, KV sharing kept)."""
    # Every field spelled out: mlx-lm's defaults are E2B's (KV sharing, double-wide MLP).
    defaults = dict(
        vocab_size=vocab_size, vocab_size_per_layer_input=vocab_size, final_logit_softcapping=30.0,
        num_kv_shared_layers=0, use_double_wide_mlp=False, attention_k_eq_v=False, enable_moe_block=False,
    )
    cfg = {**defaults, **VARIANTS[name]}
    n = cfg["num_hidden_layers"]
    if layers is not None and layers < n:
        period = cfg["layer_types"].index(F) + 1
        shared = cfg["num_kv_shared_layers"]
        if shared:
            # Keep the share of KV-shared layers, but leave one whole period of layers that own K/V.
            keep = max(2 * period, layers // period * period)
            cfg["num_kv_shared_layers"] = min(round(shared * keep / n), keep - period)
            cfg["layer_types"] = cfg["layer_types"][:keep]
        elif layers < period:
            # Less than one period: sliding layers then one full layer, so both kinds are measured.
            cfg["layer_types"] = [S] * (max(layers, 2) - 1) + [F]
        else:
            cfg["layer_types"] = cfg["layer_types"][: layers // period * period]
        cfg["num_hidden_layers"] = len(cfg["layer_types"])
    return cfg


# Layers per variant on a CPU: E2B/E4B need two periods to keep KV sharing; 26B/31B layers are
# large (a 26B layer holds 761M expert weights), so one sliding and one full layer.
CPU_LAYERS = {"e2b": 10, "e4b": 12, "26b-a4b": 2, "31b": 2}


def quant_predicate(path: str, module: nn.Module):
    """4-bit everything that can be, except the router (8-bit) and the PLE table (8-bit: 4-bit ruins it)."""
    if not hasattr(module, "to_quantized"):
        return False
    if path.endswith("router.proj") or path.endswith("embed_tokens_per_layer"):
        return {"group_size": 64, "bits": 8}
    return True


def build_pair(name: str, layers: int | None, bits: int | None, dtype=mx.bfloat16, vocab_size: int = 262_144):
    """Our model and mlx-lm's gemma4_text model sharing the same random weights."""
    from mlx_lm.models import gemma4_text

    text = variant_config(name, layers, vocab_size)
    ours = Gemma4Model(ModelConfig.from_dict({"model_type": "gemma4_text", **text}))
    ours.set_dtype(dtype)
    theirs = gemma4_text.Model(gemma4_text.ModelArgs.from_dict({"model_type": "gemma4_text", **text}))
    if bits:
        nn.quantize(ours, group_size=64, bits=bits, class_predicate=quant_predicate)
        nn.quantize(theirs, group_size=64, bits=bits, class_predicate=quant_predicate)
    ours.adapt_to_device()  # float32 experts on a CPU; theirs get the very same arrays below
    mx.eval(ours.parameters())
    # Our tree is language_model.*, theirs model.*; everything else is named alike.
    weights = [("model." + k.removeprefix("language_model."), v) for k, v in tree_flatten(ours.parameters())]
    theirs.load_weights(weights, strict=True)
    mx.eval(theirs.parameters())
    return ours, theirs, text


@dataclass
class Run:
    prefill_tps: float
    decode_tps: float
    peak_gb: float
    tokens: list[int]


def run_ours(model, prompt: mx.array, gen_tokens: int) -> Run:
    from mlx_lm.sample_utils import make_sampler

    from .generate import generate_tokens

    return _timed(generate_tokens(model, prompt, model.make_cache(), gen_tokens, make_sampler(0.0)), prompt.size, gen_tokens)


def run_mlx_lm(model, prompt: mx.array, gen_tokens: int) -> Run:
    from mlx_lm.generate import generate_step

    return _timed(((t, lp) for t, lp in generate_step(prompt, model, max_tokens=gen_tokens)), prompt.size, gen_tokens)


def _timed(steps, prompt_tokens: int, gen_tokens: int) -> Run:
    mx.synchronize()
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    first = None
    tokens = []
    for token, _ in steps:
        tokens.append(int(token))
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    n = len(tokens)
    return Run(prompt_tokens / (first - tic), (n - 1) / (end - first) if n > 1 else 0.0, mx.get_peak_memory() / 1e9, tokens)


def best(runs: list[Run]) -> Run:
    return Run(
        max(r.prefill_tps for r in runs), max(r.decode_tps for r in runs), min(r.peak_gb for r in runs), runs[0].tokens
    )


def agreement(a: list[int], b: list[int]) -> str:
    """How many greedy tokens agree before the first difference (bf16 rounding can split near-ties)."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{same}/{len(a)}"


def main(argv: list[str] | None = None) -> list[dict]:
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    p = argparse.ArgumentParser(prog="python -m gemma4_mlx.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--layers", default=None, help="layers per model ('full' for all; default: full on a GPU, CPU_LAYERS on a CPU)")
    # MLX's CPU backend has no fast quantized matmul (a 4-bit matvec is ~8x slower than bf16 there),
    # so on a CPU the default is bf16: the comparison then measures the models, not that kernel.
    p.add_argument("--bits", type=int, default=4 if on_gpu else 0, help="quantization bits (0: unquantized bf16)")
    p.add_argument("--prompt-tokens", type=int, default=512 if on_gpu else 128)
    p.add_argument("--gen-tokens", type=int, default=128 if on_gpu else 8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="unquantized weight dtype")
    p.add_argument("--vocab", type=int, default=262_144, help="vocabulary size (smaller only for quick smoke runs)")
    args = p.parse_args(argv)

    def layers_for(name: str) -> int | None:
        if args.layers == "full" or (args.layers is None and on_gpu):
            return None
        return int(args.layers) if args.layers else CPU_LAYERS[name]

    print(f"device: {mx.default_device()}, mlx {mx.__version__}, {f'{args.bits}-bit' if args.bits else args.dtype}, prompt {args.prompt_tokens}, generate {args.gen_tokens}, best of {args.repeats}")
    rows = []
    for name in args.variants:
        ours, theirs, text = build_pair(name, layers_for(name), args.bits or None, getattr(mx, args.dtype), args.vocab)
        prompt = mx.random.randint(0, text["vocab_size"], (args.prompt_tokens,), key=mx.random.key(0))
        a, b = [], []
        run_ours(ours, prompt[:8], 2)  # warm up both (kernel compilation)
        run_mlx_lm(theirs, prompt[:8], 2)
        for _ in range(args.repeats):
            a.append(run_ours(ours, prompt, args.gen_tokens))
            b.append(run_mlx_lm(theirs, prompt, args.gen_tokens))
        a, b = best(a), best(b)
        rows.append(dict(variant=name, layers=text["num_hidden_layers"], ours=a, mlx_lm=b))
        del ours, theirs
        gc.collect()
        mx.clear_cache()
        if len(rows) == 1:
            print(HEADER)
        print(_row(rows[-1]), flush=True)
    return rows


HEADER = (
    "| variant | layers | prefill tok/s (ours / mlx-lm / ratio) | decode tok/s (ours / mlx-lm / ratio) "
    "| peak GB (ours / mlx-lm) | same greedy tokens |\n|---|---|---|---|---|---|"
)


def _row(r: dict) -> str:
    a, b = r["ours"], r["mlx_lm"]
    return (
        f"| {r['variant']} | {r['layers']} | {a.prefill_tps:.1f} / {b.prefill_tps:.1f} / {a.prefill_tps / b.prefill_tps:.2f}x "
        f"| {a.decode_tps:.1f} / {b.decode_tps:.1f} / {a.decode_tps / b.decode_tps:.2f}x "
        f"| {a.peak_gb:.2f} / {b.peak_gb:.2f} | {agreement(a.tokens, b.tokens)} |"
    )


if __name__ == "__main__":
    main()
