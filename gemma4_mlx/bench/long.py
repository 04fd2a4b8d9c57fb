"""Long contexts: memory and speed of a long prefill and the decoding after it, ours and mlx-lm's.

    python -m gemma4_mlx.bench --long                                  # E2B and 31B shapes, 4K-16K
    python -m gemma4_mlx.bench --long --variants 31b --contexts 4096 32768 --layers 4

Both models get the same random bf16 weights with the variant's real shapes (``--layers`` fewer
layers, the real pattern; the default on a CPU is bench.speed's; ``--narrow`` keeps the attention's
real heads and head sizes, which make the KV cache and the attention cost, with small hidden and MLP
widths, for CPUs, where MLX's matmuls are slow). For each context, a prompt of that
many tokens is prefilled in chunks of 2048 and ``--gen-tokens`` are decoded greedily, with our
cache unquantized, 8-bit and 4-bit, and mlx-lm's unquantized and 8-bit (``kv_bits``). Printed per
run: prefill and decode tokens/s, the peak memory above the weights (KV cache and workspace: what a
context costs), the KV bytes per token, and what :mod:`gemma4_mlx.memory` predicts for that peak.
"""

from __future__ import annotations

import argparse
import gc

import mlx.core as mx

from ..variants import VARIANTS
from .speed import CPU_LAYERS, _timed, build_pair

PREFILL_STEP = 2048
SETTINGS = (("ours", None), ("ours", 8), ("ours", 4), ("mlx-lm", None), ("mlx-lm", 8))


def narrow_widths(text: dict) -> dict:
    """The variant with its real attention (heads, KV heads, head sizes, window) and small hidden,
    MLP and per-layer widths: the same KV cache and attention work, much less of the rest."""
    cfg = dict(text, hidden_size=256, intermediate_size=512, moe_intermediate_size=64)
    if cfg.get("hidden_size_per_layer_input"):
        cfg["hidden_size_per_layer_input"] = 64
    return cfg


def measure(kind: str, model, prompt: mx.array, gen_tokens: int, kv_bits: int | None) -> dict:
    """Prefill ``prompt`` and decode: speeds, the peak memory above what was allocated before
    (the weights), and the cache's bytes per token. An mlx-lm failure is returned as ``error``."""
    from mlx_lm.sample_utils import make_sampler

    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    if kind == "ours":
        from ..generation.decode import generate_tokens

        cache = model.make_cache(kv_bits=kv_bits)
        steps = generate_tokens(model, prompt, cache, gen_tokens, make_sampler(0.0), prefill_step_size=PREFILL_STEP)
    else:
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        steps = generate_step(prompt, model, max_tokens=gen_tokens, prompt_cache=cache, prefill_step_size=PREFILL_STEP,
                              kv_bits=kv_bits, kv_group_size=64, quantized_kv_start=0)  # fmt: skip
    try:
        run = _timed(steps, prompt.size, gen_tokens)
    except Exception as e:  # mlx-lm's quantized cache on Gemma 4's sliding layers
        return {"error": f"{type(e).__name__}: {e}"}
    kv = sum(c.nbytes for c in cache)
    return {"prefill_tps": run.prefill_tps, "decode_tps": run.decode_tps, "peak_gb": run.peak_gb - before / 1e9,
            "kv_per_token": kv / (prompt.size + gen_tokens), "tokens": run.tokens}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    from ..config import ModelConfig
    from ..memory import context_bytes

    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    p = argparse.ArgumentParser(prog="python -m gemma4_mlx.bench --long", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=["e2b", "31b"], choices=list(VARIANTS))
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--layers", default=None, help="layers per model ('full' for all; default: full on a GPU, CPU_LAYERS on a CPU)")
    p.add_argument("--gen-tokens", type=int, default=8)
    p.add_argument("--vocab", type=int, default=262_144)
    p.add_argument("--narrow", action="store_true", help="real attention shapes, small other widths (quick on a CPU)")
    args = p.parse_args(argv)
    widths = "real attention shapes, narrow other widths" if args.narrow else "real shapes"
    print(f"device: {mx.default_device()}, mlx {mx.__version__}, bf16 weights, {widths}, prefill chunks of {PREFILL_STEP}, {args.gen_tokens} decoded tokens")
    print(HEADER)
    rows = []
    for name in args.variants:
        layers = None if args.layers == "full" or (args.layers is None and on_gpu) else int(args.layers or CPU_LAYERS[name])
        ours, theirs, text = build_pair(name, layers, None, mx.bfloat16, args.vocab, edit=narrow_widths if args.narrow else None)
        config = ModelConfig.from_dict({"model_type": "gemma4_text", **text}).text_config
        warm = mx.random.randint(0, text["vocab_size"], (64,), key=mx.random.key(1))
        for kind, bits in SETTINGS:  # compile kernels and traces before anything is timed
            measure(kind, ours if kind == "ours" else theirs, warm, 2, bits)
        for context in args.contexts:
            prompt = mx.random.randint(0, text["vocab_size"], (context,), key=mx.random.key(0))
            results = {}
            for kind, bits in SETTINGS:
                r = measure(kind, ours if kind == "ours" else theirs, prompt, args.gen_tokens, bits)
                results[(kind, bits)] = r
                est = context_bytes(config, context + args.gen_tokens, PREFILL_STEP, 2, bits) / 1e9 if kind == "ours" else None
                rows.append(dict(variant=name, layers=text["num_hidden_layers"], context=context, kind=kind, kv_bits=bits, estimate_gb=est, **r))
                print(_row(rows[-1], results[("ours", None)] if kind == "mlx-lm" else None), flush=True)
            del results
        del ours, theirs
        gc.collect()
        mx.clear_cache()
    return rows


HEADER = (
    "| variant (layers) | context | cache | prefill tok/s | decode tok/s | peak above weights, GB (estimate) "
    "| KV bytes/token | same greedy tokens as ours |\n|---|---|---|---|---|---|---|---|"
)


def _row(r: dict, ours: dict | None) -> str:
    cache = f"{r['kind']}, {'bf16' if r['kv_bits'] is None else str(r['kv_bits']) + '-bit'}"
    head = f"| {r['variant']} ({r['layers']}) | {r['context']} | {cache} "
    if "error" in r:
        return head + f"| fails: {r['error'][:70]} | | | | |"
    estimate = f" ({r['estimate_gb']:.2f})" if r["estimate_gb"] is not None else ""
    same = "" if ours is None or "tokens" not in ours else f"{sum(a == b for a, b in zip(r['tokens'], ours['tokens']))}/{len(ours['tokens'])}"
    return head + (
        f"| {r['prefill_tps']:.0f} | {r['decode_tps']:.1f} | {r['peak_gb']:.2f}{estimate} | {r['kv_per_token']:.0f} | {same} |"
    )


if __name__ == "__main__":
    main()
