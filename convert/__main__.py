"""Command line: ``python -m convert --hf-path google/gemma-4-E2B-it --mlx-path gemma-4-e2b-4bit -q``."""

from __future__ import annotations

import argparse
import sys

from .converter import DTYPES, MODES, RECIPES, convert


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m convert", description="Convert a Gemma 4 checkpoint to MLX.")
    p.add_argument("--hf-path", required=True, help="local Hugging Face folder or Hub repo id")
    p.add_argument("--mlx-path", required=True, help="output folder (an existing one is refused unless empty or --force)")
    p.add_argument("--force", action="store_true", help="replace the output of an earlier conversion (never any other folder)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of unquantized weights")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize linear layers and the embedding")
    p.add_argument("--q-bits", type=int, default=4, help="bits per weight (affine: 2,3,4,5,6,8)")
    p.add_argument("--q-group-size", type=int, default=64, help="32, 64 or 128 (mxfp modes: 32)")
    p.add_argument("--q-mode", choices=list(MODES), default="affine")
    p.add_argument("--quant-recipe", choices=RECIPES, default=None,
                   help="mixed_L_H: L bits, H bits for sensitive v_proj/down_proj layers and the embedding")  # fmt: skip
    p.add_argument("--quantize-towers", action="store_true", help="also quantize the vision/audio towers")
    p.add_argument("--max-shard-gb", type=float, default=5.0)
    args = p.parse_args(argv)
    try:
        convert(
            args.hf_path, args.mlx_path, dtype=args.dtype, quantize=args.quantize or args.quant_recipe is not None,
            q_bits=args.q_bits, q_group_size=args.q_group_size, q_mode=args.q_mode, quant_recipe=args.quant_recipe,
            quantize_towers=args.quantize_towers, force=args.force, max_shard_gb=args.max_shard_gb,
        )  # fmt: skip
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
