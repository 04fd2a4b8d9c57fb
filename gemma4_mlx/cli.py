"""The command line: ``python -m gemma4_mlx --model ... --prompt ...`` (also ``gemma4-generate``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .distributed.watchdog import EXIT_CODE as EXIT_PEER_LOST
from .errors import PeerLostError
from .generation.options import GenerationOptions
from .generation.speculative import DEFAULT_DRAFT_TOKENS
from .generation.stream import stream_generate


def _read_stdin() -> str:
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"standard input is not UTF-8 text (byte {e.start} of {len(data)}); convert it first, e.g. with iconv") from None


def main(argv: list[str] | None = None) -> int:
    from .distributed import load_sharded, world
    from .loading import load

    p = argparse.ArgumentParser(prog="python -m gemma4_mlx", description="Generate text with Gemma 4 on MLX.")
    p.add_argument("--model", required=True, help="local folder (HF or converted) or Hub repo id")
    p.add_argument("--prompt", required=True, help="the user message ('-' reads standard input)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--image", action="append", default=[], help="an image file (repeatable)")
    p.add_argument("--audio", action="append", default=[], help="an audio file (repeatable; E2B, E4B and 12B)")
    p.add_argument("--video", action="append", default=[], help="a video file (repeatable)")
    p.add_argument("--image-tokens", type=int, default=None, help="image token budget: 70, 140, 280 (default), 560, 1120")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--thinking", action="store_true", help="let the model reason before answering")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", "--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.add_argument("--draft-model", default=None, help="a Gemma 4 assistant (folder or Hub id) for speculative decoding")
    p.add_argument("--num-draft-tokens", type=int, default=DEFAULT_DRAFT_TOKENS, help="tokens drafted per target step (with --draft-model)")
    p.add_argument("--kv-bits", type=int, default=None, help="quantize the KV cache to 8 or 4 bits per value (long contexts in less memory)")
    p.add_argument("--kv-group-size", type=int, default=64, help="values sharing a scale in the quantized KV cache: 32, 64, 128")
    p.add_argument("--quiet", action="store_true", help="print only the generated text")
    p.add_argument("--parallel", choices=["pipeline", "tensor"], default="pipeline",
                   help="under mlx.launch with several processes: how the model is shared (pipeline: a run of layers each; "
                        "tensor: every layer split, for fast links)")  # fmt: skip
    p.add_argument("--split", default=None, help="layers per process, e.g. 20,15 (default: in proportion to each machine's memory)")
    args = p.parse_args(argv)

    group = None
    try:
        text = _read_stdin() if args.prompt == "-" else args.prompt
        options = dict(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
            enable_thinking=args.thinking, max_soft_tokens=args.image_tokens, kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
        )  # fmt: skip
        GenerationOptions(**options)  # bad values fail here, before the model loads
        group = world()
        if group is None:
            model, processor = load(args.model, dtype=args.dtype)
        else:  # started by mlx.launch: this process runs its part; rank 0 prints
            model, processor = load_sharded(args.model, group, parallel=args.parallel, split=args.split, dtype=args.dtype)
            if group.rank() != 0:
                sys.stdout = open(os.devnull, "w")
            elif not args.quiet:
                how = model.stage.describe() if model.stage is not None else "every layer split"
                print(f"{args.parallel} over {group.size()} processes: {how}", file=sys.stderr)
        if args.raw:
            prompt: Any = text
        else:
            media = [{"type": "image", "path": f} for f in args.image] + [{"type": "audio", "path": f} for f in args.audio]
            media += [{"type": "video", "path": f} for f in args.video]
            content = media + [{"type": "text", "text": text}] if media else text
            prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": content}]
        last = None
        draft = dict(draft_model=args.draft_model, num_draft_tokens=args.num_draft_tokens) if args.draft_model else {}
        for chunk in stream_generate(model, processor, prompt, **draft, **options):
            print(chunk.text, end="", flush=True)
            last = chunk
        print()
        if last is not None and not args.quiet:
            where = f"[rank {group.rank()}] " if group is not None else ""
            print(where + last.summary(), file=sys.stderr)
    except PeerLostError as e:
        print(f"error: {e}. Stopping.", file=sys.stderr)
        return EXIT_PEER_LOST
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
