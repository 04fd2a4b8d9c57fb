"""Benchmark: gemma4-mlx against mlx-lm's own Gemma 4 model, on the same random weights, in one run.

    python -m gemma4_mlx.bench                       # all four variant shapes, 4-bit
    python -m gemma4_mlx.bench --variants e2b 31b --prompt-tokens 512 --gen-tokens 128 --layers full
    python -m gemma4_mlx.bench --step                # one decode step counted (bench/step.py)

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
import warnings
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from ..config import ModelConfig
from ..loading import adapt_to_device
from ..loading.quantization import QuantizationPlan, quantize_model
from ..models.gemma4 import Gemma4Model
from ..variants import VARIANTS, variant_config

# Layers per variant on a CPU: E2B/E4B need two periods to keep KV sharing; 26B/31B layers are
# large (a 26B layer holds 761M expert weights), so one sliding and one full layer.
CPU_LAYERS = {"e2b": 10, "e4b": 12, "12b": 2, "26b-a4b": 2, "31b": 2}


def narrow(text: dict) -> dict:
    """The variant's layer structure with small widths: the same graph, cheap to build (tests, CPUs)."""
    cfg = dict(text)
    ple = 64 if cfg.get("hidden_size_per_layer_input") else 0
    cfg.update(hidden_size=128, intermediate_size=256, head_dim=64, global_head_dim=128, hidden_size_per_layer_input=ple)
    if cfg.get("enable_moe_block"):
        cfg.update(moe_intermediate_size=64)
    return cfg


def build_pair(name: str, layers: int | None, bits: int | None, dtype=mx.bfloat16, vocab_size: int = 262_144, edit=None, merge: bool = True):
    """Our model and mlx-lm's gemma4_text model sharing the same random weights (``edit`` changes
    the text config first, e.g. :func:`narrow`); ours with its projections
    merged as ``load_model`` does, unless ``merge`` is False."""
    from mlx_lm.models import gemma4_text

    text = variant_config(name, layers, vocab_size)
    if edit is not None:
        text = edit(text)
    ours = Gemma4Model(ModelConfig.from_dict({"model_type": "gemma4_text", **text}))
    ours.set_dtype(dtype)
    theirs = gemma4_text.Model(gemma4_text.ModelArgs.from_dict({"model_type": "gemma4_text", **text}))
    if bits:  # the converter's rules (8-bit router and PLE table), on both module trees
        quantize_model(ours, QuantizationPlan(bits, 64, "affine"))
        quantize_model(theirs, QuantizationPlan(bits, 64, "affine"))
    with warnings.catch_warnings():  # the CPU's float32 experts are expected here: theirs get the same arrays below
        warnings.simplefilter("ignore")
        adapt_to_device(ours)
    mx.eval(ours.parameters())
    # Our tree is language_model.*, theirs model.*; everything else is named alike.
    weights = [("model." + k.removeprefix("language_model."), v) for k, v in tree_flatten(ours.parameters())]
    theirs.load_weights(weights, strict=True)
    mx.eval(theirs.parameters())
    if merge:
        ours.merge_projections()
        ours.materialize()
    return ours, theirs, text


@dataclass
class Run:
    prefill_tps: float
    decode_tps: float
    peak_gb: float
    tokens: list[int]


def run_ours(model, prompt: mx.array, gen_tokens: int) -> Run:
    from mlx_lm.sample_utils import make_sampler

    from ..generation.decode import generate_tokens

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
    p.add_argument("--narrow", action="store_true", help="each variant's layers with small widths (quick smoke runs)")
    args = p.parse_args(argv)

    def layers_for(name: str) -> int | None:
        if args.layers == "full" or (args.layers is None and on_gpu):
            return None
        return int(args.layers) if args.layers else CPU_LAYERS[name]

    widths = ", narrow widths" if args.narrow else ""
    print(f"device: {mx.default_device()}, mlx {mx.__version__}, {f'{args.bits}-bit' if args.bits else args.dtype}{widths}, prompt {args.prompt_tokens}, generate {args.gen_tokens}, best of {args.repeats}")
    rows = []
    for name in args.variants:
        ours, theirs, text = build_pair(name, layers_for(name), args.bits or None, getattr(mx, args.dtype), args.vocab, edit=narrow if args.narrow else None)
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
