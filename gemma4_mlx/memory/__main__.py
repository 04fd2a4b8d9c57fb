"""``python -m gemma4_mlx.memory``: the memory a model needs at a context, and the longest context
that fits (a model folder, a Hub id, or a bare config.json; no weights are read)."""

from __future__ import annotations

import argparse
import sys

from ..models.cache import KV_BITS, KV_GROUP_SIZES
from . import GB, device_memory, estimate, longest_context, process_estimates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gemma4_mlx.memory", description=__doc__.split("\n\n")[0].strip("`"))
    p.add_argument("--model", required=True, help="model folder, Hub repo id, or a config.json")
    p.add_argument("--context", type=int, nargs="+", default=[4096, 32768, 131072], help="context lengths in tokens")
    p.add_argument("--memory", type=float, default=None, help="GB available (default: this device's)")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--kv-bits", type=int, default=None, choices=KV_BITS, help="a quantized KV cache (default: bf16)")
    p.add_argument("--kv-group-size", type=int, default=64, choices=KV_GROUP_SIZES)
    p.add_argument("--processes", type=int, default=1, help="machines sharing the model (mlx.launch): memory per machine")
    p.add_argument("--parallel", choices=["pipeline", "tensor"], default="pipeline", help="with --processes: how they share it")
    p.add_argument("--split", default=None, help="with --processes: layers per machine of a pipeline, e.g. 20,15 (default: even)")
    args = p.parse_args(argv)
    kv = dict(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size)
    try:
        for n in args.context:
            if n < 1:
                raise ValueError(f"--context must be positive, not {n}")
            if args.processes > 1:
                for rank, (layers, e) in enumerate(process_estimates(args.model, n, args.processes, args.split, args.prefill_step_size, parallel=args.parallel, **kv)):
                    print(f"process {rank} ({layers}): {e.summary()}")
                continue
            print(estimate(args.model, n, args.prefill_step_size, **kv).summary())
        if args.processes > 1:
            return 0
        memory = args.memory * GB if args.memory else device_memory()
        print(f"longest context within {memory / GB:.1f} GB: {longest_context(args.model, memory, args.prefill_step_size, **kv)} tokens")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
