"""Resident memory of a 4-bit E2B: gemma4-mlx (PLE table mapped or loaded) and mlx-lm, same folder.

    python -m gemma4_mlx.bench.memory                           # writes ~3.8 GB to a temporary folder
    python -m gemma4_mlx.bench.memory --folder /tmp/e2b-4bit    # keeps (or reuses) the folder

It writes a random checkpoint with E2B's real text shapes (35 layers, vocabulary 262144, PLE table
262144 x 35*256), quantized by ``python -m convert``'s rules (4-bit, group 64; the PLE table at
8 bits), in mlx-lm's ``gemma4_text`` layout, which both libraries load. Each model is then loaded
by ``gemma4_mlx.load`` / ``mlx_lm.load`` in a fresh process, which reports its resident memory
(``VmRSS`` from /proc, split into anonymous memory and mapped file pages) after loading, the peak
(``VmHWM``) while loading and, reset through /proc/self/clear_refs, while prefilling a prompt and
greedily generating, and MLX's own allocator peak. Last, one process loads both of our variants
and times decoding alternately (best of ``--repeats``): the price of reading PLE rows from disk.
Linux only (/proc).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

KINDS = ("ours-lazy-ple", "ours-full-ple", "mlx-lm")


# --------------------------------------------------------------------------- the checkpoint
def write_checkpoint(folder: str | Path, variant: str = "e2b", bits: int = 4, group_size: int = 64,
                     layers: int | None = None, vocab_size: int = 262_144, seed: int = 0, text: dict | None = None,
                     progress=print) -> Path:  # fmt: skip
    """A random ``gemma4_text`` folder, quantized to ``bits`` (None: bf16), with the variant's real shapes (or the text config
    ``text``), in mlx-lm's layout (``model.*`` names, per-module quantization overrides keyed alike),
    with the tiny tokenizer padded to the vocabulary."""
    from convert.converter import write_shards

    from ..config import ModelConfig
    from ..loading.quantization import QuantizationPlan, quantize_model
    from ..models.gemma4 import Gemma4Model
    from ..testing import write_tokenizer
    from ..variants import variant_config

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = text or variant_config(variant, layers, vocab_size)
    config = {"model_type": "gemma4_text", "tie_word_embeddings": True, **text}
    mx.random.seed(seed)
    model = Gemma4Model(ModelConfig.from_dict(config))  # lazy: initial values computed when saved
    model.set_dtype(mx.bfloat16)
    plan = quantize_model(model, QuantizationPlan(bits, group_size, "affine")) if bits else None  # None: bf16
    lm = model.language_model
    if "embed_tokens_per_layer" in lm and plan is not None:
        # Built in row blocks: the whole float table at once would need 9.4 GB (float32 draws).
        table = lm.embed_tokens_per_layer
        rows, dims = table.weight.shape[0], table.scales.shape[1] * table.group_size
        parts = []
        for start in range(0, rows, 8192):
            n = min(8192, rows - start)
            block = (mx.random.normal((n, dims)) * dims**-0.5).astype(mx.bfloat16)
            parts.append(mx.quantize(block, group_size=table.group_size, bits=table.bits))
            mx.eval(parts[-1])
        table.weight, table.scales, table.biases = (mx.concatenate(p) for p in zip(*parts))
        del parts
    rename = lambda k: "model." + k.removeprefix("language_model.")  # noqa: E731
    weights = {rename(k): v for k, v in tree_flatten(model.parameters())}
    write_shards(folder, weights, 2_000_000_000, progress)
    del model, weights
    gc.collect()
    mx.clear_cache()
    if plan is not None:
        config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine",
                                  **{rename(k): v for k, v in plan.overrides.items()}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(folder, vocab_size=text["vocab_size"])
    return folder


# --------------------------------------------------------------------------- measuring (child process)
def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(kind: str, folder: Path, prompt_tokens: int, gen_tokens: int) -> dict:
    """Load ``folder`` as ``kind`` and generate; memory figures in bytes."""
    from .speed import run_mlx_lm, run_ours

    before = proc_status()
    tic = time.perf_counter()
    if kind == "mlx-lm":
        import mlx_lm

        model, _ = mlx_lm.load(str(folder))
    else:
        from ..loading import load

        model, _ = load(folder, lazy_ple=kind == "ours-lazy-ple")
    load_s = time.perf_counter() - tic
    gc.collect()
    loaded = proc_status()
    result = dict(kind=kind, load_s=load_s, before=before, loaded=loaded, mlx_active_loaded=mx.get_active_memory(),
                  mlx_peak_loading=mx.get_peak_memory())  # fmt: skip
    result["hwm_reset"] = reset_peak_rss()
    vocab = model.args.vocab_size if kind == "mlx-lm" else model.text_config.vocab_size
    prompt = mx.random.randint(0, vocab, (prompt_tokens,), key=mx.random.key(1))
    run = run_mlx_lm(model, prompt, gen_tokens) if kind == "mlx-lm" else run_ours(model, prompt, gen_tokens)
    result.update(generated=proc_status(), mlx_peak_generating=int(run.peak_gb * 1e9), prefill_tps=run.prefill_tps,
                  decode_tps=run.decode_tps, tokens=run.tokens)  # fmt: skip
    return result


def decode_speed(folder: Path, prompt_tokens: int, gen_tokens: int, repeats: int) -> dict:
    """Ours with the PLE table mapped and loaded, in one process, timed alternately: best tok/s."""
    from .speed import run_ours
    from ..loading import load

    models = {kind: load(folder, lazy_ple=kind == "ours-lazy-ple")[0] for kind in KINDS[:2]}
    vocab = models[KINDS[0]].text_config.vocab_size
    prompt = mx.random.randint(0, vocab, (prompt_tokens,), key=mx.random.key(1))
    runs = {kind: [] for kind in models}
    for model in models.values():
        run_ours(model, prompt[:8], 2)  # warm up
    for _ in range(repeats):
        for kind, model in models.items():
            runs[kind].append(run_ours(model, prompt, gen_tokens))
    return {
        kind: dict(prefill_tps=max(r.prefill_tps for r in rs), decode_tps=max(r.decode_tps for r in rs),
                   all_decode_tps=[r.decode_tps for r in rs], tokens=rs[0].tokens,
                   ple_lookup_ms=ple_lookup_ms(models[kind]))  # fmt: skip
        for kind, rs in runs.items()
    }


def ple_lookup_ms(model, n: int = 200) -> float:
    """Median milliseconds of one decode step's PLE token lookup (the only part that differs)."""
    import numpy as np

    lm = model.language_model
    ids = np.random.default_rng(0).integers(0, model.text_config.vocab_size, n)
    times = []
    for i in ids:
        tok = mx.array([[int(i)]]) + 0  # lazy, as a sampled token is
        tic = time.perf_counter()
        mx.eval(lm.per_layer_token_inputs(tok))
        times.append(time.perf_counter() - tic)
    return float(np.median(times) * 1e3)


def _child(args) -> None:
    folder = Path(args.folder)
    if args.child == "speed":
        out = decode_speed(folder, args.prompt_tokens, args.gen_tokens, args.repeats)
    else:
        out = measure(args.child, folder, args.prompt_tokens, args.gen_tokens)
    print("RESULT " + json.dumps(out))


def _run_child(what: str, args, prompt_tokens: int | None = None, gen_tokens: int | None = None) -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])  # so the child imports this checkout
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "gemma4_mlx.bench.memory", "--child", what, "--folder", str(args.folder),
           "--prompt-tokens", str(prompt_tokens or args.prompt_tokens), "--gen-tokens", str(gen_tokens or args.gen_tokens), "--repeats", str(args.repeats)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


# --------------------------------------------------------------------------- the table
def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def memory_table(results: list[dict]) -> str:
    rows = [
        "| model | RSS at start GB | RSS after load (anon + file) GB | peak RSS loading GB | peak RSS generating GB "
        "| MLX peak generating GB | load s | prefill tok/s | decode tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        loaded, gen = r["loaded"], r["generated"]
        rows.append(
            f"| {r['kind']} | {_gb(r['before']['VmRSS'])} "
            f"| {_gb(loaded['VmRSS'])} ({_gb(loaded['RssAnon'])} + {_gb(loaded['RssFile'])}) "
            f"| {_gb(loaded['VmHWM'])} | {_gb(gen['VmHWM'])}{'' if r['hwm_reset'] else ' (since start)'} "
            f"| {_gb(r['mlx_peak_generating'])} | {r['load_s']:.1f} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m gemma4_mlx.bench.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", default=None, help="checkpoint folder: reused if it holds one, else written (kept)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="alternate timing runs of the decode-speed comparison")
    p.add_argument("--kinds", nargs="*", choices=KINDS, default=list(KINDS), help="what to load (none: speed only)")
    p.add_argument("--speed-prompt-tokens", type=int, default=8, help="prompt of the decode-speed comparison")
    p.add_argument("--speed-gen-tokens", type=int, default=8, help="tokens generated in the decode-speed comparison")
    p.add_argument("--no-speed", action="store_true", help="skip the lazy/full PLE decode-speed comparison")
    p.add_argument("--variant", choices=["e2b", "e4b"], default="e2b")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (smoke runs only; default: all)")
    p.add_argument("--vocab", type=int, default=262_144, help="vocabulary size (smaller only for smoke runs)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return {}

    tmp = None
    if args.folder is None:
        tmp = tempfile.TemporaryDirectory(prefix="gemma4-e2b-4bit-")
        args.folder = tmp.name
    folder = Path(args.folder)
    try:
        if not (folder / "config.json").exists():
            print(f"writing a random 4-bit {args.variant}-shaped checkpoint to {folder} ...", flush=True)
            tic = time.perf_counter()
            write_checkpoint(folder, args.variant, layers=args.layers, vocab_size=args.vocab)
            print(f"  done in {time.perf_counter() - tic:.0f} s", flush=True)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(f"device: {mx.default_device()}, mlx {mx.__version__}; folder {_gb(size)} GB; memory runs: prompt "
              f"{args.prompt_tokens} tokens, {args.gen_tokens} generated; speed runs: {args.speed_prompt_tokens} and "
              f"{args.speed_gen_tokens} (greedy)", flush=True)  # fmt: skip
        results = []
        for kind in args.kinds:
            results.append(_run_child(kind, args))
            print(f"  {kind}: done", flush=True)
        if results:
            print(memory_table(results))
            tokens = {r["kind"]: r["tokens"] for r in results}
            print("same greedy tokens as " + results[0]["kind"] + ": "
                  + ", ".join(f"{k} {v == tokens[results[0]['kind']]}" for k, v in tokens.items()))  # fmt: skip
        speed = None
        if not args.no_speed:
            speed = _run_child("speed", args, args.speed_prompt_tokens, args.speed_gen_tokens)
            lazy, full = speed[KINDS[0]], speed[KINDS[1]]
            print(f"decode tok/s, one process, alternating, best of {args.repeats}: PLE mapped {lazy['decode_tps']:.3f}, "
                  f"loaded {full['decode_tps']:.3f} (mapped/loaded {lazy['decode_tps'] / full['decode_tps']:.3f}x); "
                  f"runs {lazy['all_decode_tps']} / {full['all_decode_tps']}; same tokens {lazy['tokens'] == full['tokens']}")  # fmt: skip
            print(f"PLE token lookup per decode step (median of 200): mapped {lazy['ple_lookup_ms']:.3f} ms, "
                  f"loaded {full['ple_lookup_ms']:.3f} ms")  # fmt: skip
        out = dict(memory=results, speed=speed, prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return out
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
