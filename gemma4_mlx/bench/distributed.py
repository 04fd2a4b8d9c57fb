"""Pipeline and tensor parallelism measured: one process against 2 (and 3) over ``mlx.launch``
(ring backend), on one random checkpoint with a variant's real widths, and what mlx-lm does with
the same folder.

    python -m gemma4_mlx.bench.distributed                      # 12b widths, 6 layers, bf16
    python -m gemma4_mlx.bench.distributed --variant 31b --layers 6 --processes 2 --parallel tensor

For each run: whether the greedy tokens equal one process's and how far the first token's
log-probabilities are from one process's, prefill and decode speed, each process's weights (what it
holds) and MLX's active memory after loading, and its traffic (transfers and bytes per generated
token, and their time on the link as measured at load); then the time one hop of a decode step's
residual stream takes on this link (a send/receive ping-pong, median of 50). On one machine the
processes share its cores and memory bandwidth, so the speeds say what splitting costs, not what
two Macs gain; the memory per process is what each Mac would hold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..config import ModelConfig
from ..distributed.tensor import check_divisible

RESULT = "RESULT "


def _worker(args) -> None:
    """One process of a run (``--worker``): load (sharded under mlx.launch), generate, measure."""
    from ..distributed import load_sharded, world
    from ..generation.stream import stream_generate
    from ..loading import load

    group, parallel = world(), args.parallel[0]
    start = time.perf_counter()
    model, processor = load_sharded(args.folder, group, parallel=parallel) if group else load(args.folder)
    loaded_s, active = time.perf_counter() - start, mx.get_active_memory()
    prompt = list(range(10, 10 + args.prompt_tokens))
    last, tokens = None, []
    for chunk in stream_generate(model, processor, prompt, max_tokens=args.gen_tokens):
        if not tokens:  # the first token's log-probabilities, to compare with one process's
            np.save(Path(args.folder) / f"logprobs-{parallel if group else 'one'}-{group.rank() if group else 0}.npy",
                    np.array(chunk.logprobs.astype(mx.float32)))  # fmt: skip
        tokens.append(chunk.token)
        last = chunk
    layers = "all" if not group else f"{model.stage.start}-{model.stage.end - 1}" if model.stage else f"1/{group.size()} of each"
    out = {
        "rank": group.rank() if group else 0, "layers": layers,
        "tokens": tokens, "prefill_tps": last.prompt_tps, "decode_tps": last.generation_tps, "load_s": loaded_s,
        "weights": sum(v.nbytes for _, v in tree_flatten(model.parameters())), "active": active,
    }  # fmt: skip
    if group:
        t = last.traffic
        out.update(transfers=t.transfers / len(tokens), kbytes=t.bytes / len(tokens) / 1e3, link_s=t.seconds, latency_ms=t.latency * 1e3)
        out["hop_ms"] = _hop_ms(group, model.text_config.hidden_size, model.language_model.norm.weight.dtype)
    print(RESULT + json.dumps(out), flush=True)


def _hop_ms(group, hidden: int, dtype) -> float:
    """Median time of one hop of a decode step's residual stream ([1, 1, hidden]) between ranks 0
    and 1: half a send/receive round trip."""
    x = mx.zeros((hidden,), dtype=dtype)
    times = []
    for _ in range(50):
        start = time.perf_counter()
        if group.rank() == 0:
            mx.eval(mx.distributed.send(x, 1, group=group))
            mx.eval(mx.distributed.recv_like(x, 1, group=group))
        elif group.rank() == 1:
            y = mx.distributed.recv_like(x, 0, group=group)
            mx.eval(mx.distributed.send(y, 0, group=group))
        times.append((time.perf_counter() - start) / 2 * 1e3)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))  # the others wait here
    return statistics.median(times)


def _run(args, processes: int, parallel: str = "pipeline") -> list[dict]:
    # This CPU takes minutes for a prefill a Mac does in a second: a far longer wait than the default.
    env = {**os.environ, "GEMMA4_MLX_DISTRIBUTED_TIMEOUT": os.environ.get("GEMMA4_MLX_DISTRIBUTED_TIMEOUT", "1800")}
    root = str(Path(__file__).resolve().parents[2])  # so every process imports this checkout
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    worker = [sys.executable, "-m", "gemma4_mlx.bench.distributed", "--worker", "--folder", str(args.folder), "--parallel", parallel,
              "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)]  # fmt: skip
    launch = [str(Path(sys.executable).parent / "mlx.launch"), "-n", str(processes), "--backend", "ring"] if processes > 1 else []
    proc = subprocess.run(launch + worker, capture_output=True, text=True, env=env)
    lines = [json.loads(l[len(RESULT) :]) for l in proc.stdout.splitlines() if l.startswith(RESULT)]
    if proc.returncode != 0 or len(lines) != processes:
        raise RuntimeError(f"{processes} process(es) failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return sorted(lines, key=lambda l: l["rank"])


def _mlx_lm(folder: Path, parallel: str) -> str:
    """What mlx-lm's sharded loader says of the folder (in this process: a group of one)."""
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init()
    try:
        sharded_load(str(folder), **{f"{parallel}_group": group})
        return "loads"
    except Exception as e:  # what it raises is the finding
        return f"refuses: {type(e).__name__}: {e}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gemma4_mlx.bench.distributed", description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="12b")
    p.add_argument("--layers", type=int, default=6, help="decoder layers (whole pattern periods)")
    p.add_argument("--bits", type=int, default=None, help="quantize the weights (default bf16: MLX's CPU backend has no fast quantized matmul)")
    p.add_argument("--processes", type=int, nargs="+", default=[2, 3])
    p.add_argument("--parallel", nargs="+", choices=["pipeline", "tensor"], default=["pipeline", "tensor"],
                   help="how the processes share the model (tensor runs only where the heads divide)")  # fmt: skip
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=8)
    p.add_argument("--folder", default=None, help="checkpoint folder: reused if it holds one, else written")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    from .memory import write_checkpoint

    if args.folder is None:
        args.folder = Path(tempfile.mkdtemp(prefix="gemma4-dist-"))
    args.folder = Path(args.folder)
    if not (args.folder / "config.json").exists():
        write_checkpoint(args.folder, args.variant, bits=args.bits, layers=args.layers, progress=lambda *a: None)
    print(f"{args.variant} widths, {args.layers} layers, {'bf16' if args.bits is None else f'{args.bits}-bit'}, "
          f"prompt {args.prompt_tokens} tokens, {args.gen_tokens} generated; ring backend over localhost\n")  # fmt: skip
    single = _run(args, 1)[0]
    reference = np.load(args.folder / "logprobs-one-0.npy")
    rows = [("1", "-", single, 0.0)]
    config = ModelConfig.from_file(args.folder / "config.json").text_config
    for parallel in args.parallel:
        for n in args.processes:
            if parallel == "tensor":
                try:
                    check_divisible(config, n)
                except ValueError as e:
                    print(f"{parallel}, {n} processes: skipped ({e})")
                    continue
            for r in _run(args, n, parallel):
                diff = float(np.abs(np.load(args.folder / f"logprobs-{parallel}-{r['rank']}.npy") - reference).max())
                rows.append((f"{n}, rank {r['rank']}", parallel, r, diff))
    print("| processes | parallel | layers | same tokens | first logprobs, max diff | prefill tok/s | decode tok/s | weights GB "
          "| active GB after loading | per token: transfers, KB | link time (est.) | load s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, parallel, r, diff in rows:
        same = "yes" if r["tokens"] == single["tokens"] else "NO"
        traffic = f"{r['transfers']:.0f}, {r['kbytes']:.1f}" if "transfers" in r else "-"
        link = f"{r['link_s']:.3f} s" if "link_s" in r else "-"
        print(f"| {name} | {parallel} | {r['layers']} | {same} | {diff:.2g} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} "
              f"| {_gb(r['weights'])} | {_gb(r['active'])} | {traffic} | {link} | {r['load_s']:.1f} |")  # fmt: skip
    hops = [r["hop_ms"] for _, _, r, _ in rows if "hop_ms" in r and r["rank"] == 0]
    latency = [r["latency_ms"] for _, _, r, _ in rows if "latency_ms" in r and r["rank"] == 0]
    print(f"\none hop of a decode step's residual stream ({config.hidden_size * 2} bytes, bf16) here: "
          f"{', '.join(f'{h:.3f} ms' for h in hops)} (median of 50); an all_sum of it, measured at load: "
          f"{', '.join(f'{h:.3f} ms' for h in latency)}")
    for parallel in args.parallel:
        print(f"mlx-lm (mlx_lm.utils.sharded_load, {parallel} group): {_mlx_lm(args.folder, parallel)}")

if __name__ == "__main__":
    main()
