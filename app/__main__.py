"""python -m app: chat with Gemma 4 in the browser.

    python -m app                                   # google/gemma-4-E2B-it, converted to 4-bit on first use
    python -m app --model ./gemma-4-31b-4bit        # a converted folder, an HF folder or a Hub repo id
    python -m app --demo                            # a tiny random model: try the interface, no download
"""

from __future__ import annotations

import argparse
import sys

from .backend import CACHE_DIR, DEFAULT_MODEL, ModelHolder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app", description="A local multimodal chat with Gemma 4 on MLX.")
    p.add_argument("--model", default=None, help=f"converted folder, HF folder or Hub repo id (default: {DEFAULT_MODEL})")
    p.add_argument("--quantize", type=int, default=None, choices=[4, 8], metavar="BITS",
                   help=f"convert an unquantized checkpoint to BITS (4 or 8) on first use, cached in {CACHE_DIR} "
                        "(default: 4 for the default model, none otherwise)")  # fmt: skip
    p.add_argument("--no-quantize", action="store_true", help="load the default model unconverted (bf16)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.add_argument("--demo", action="store_true", help="use a tiny random model built locally (replies are gibberish)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: localhost only)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="also publish a temporary public gradio.live link")
    p.add_argument("--no-browser", action="store_true", help="do not open the browser")
    args = p.parse_args(argv)

    bits = args.quantize
    if bits is None and args.model is None and not args.no_quantize:
        bits = 4
    from .ui import build_app

    holder = ModelHolder(args.model, bits, demo=args.demo, dtype=args.dtype).start()
    app = build_app(holder)
    app.queue().launch(server_name=args.host, server_port=args.port, share=args.share, inbrowser=not args.no_browser)
    return 0


if __name__ == "__main__":
    sys.exit(main())
