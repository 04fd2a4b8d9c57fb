"""Benchmark: prefix reuse across chat turns (the cost of a new turn), with and without reuse.

    python -m gemma4_mlx.bench.chat                                # E2B shapes, CPU-sized defaults
    python -m gemma4_mlx.bench.chat --variant 31b --history 1024 4096 16384 --layers full --bits 4

A conversation starts with a long first message (``--history`` tokens), gets a reply, then a short
second message (``--new`` tokens). The table shows the second turn's prompt size, how much of it was
reused from the cache, the tokens actually prefilled, and the time to first token, with
:class:`~gemma4_mlx.chat.ChatEngine`'s prefix reuse and without it (a fresh cache each turn).
With reuse, the second turn's cost follows the new tokens, not the length of the conversation.

A second table shows how fast a reply decodes: the engine (its model work on its own thread) beside
mlx-lm's ``stream_generate`` on the same weights, in one run.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import mlx.core as mx

from ..variants import VARIANTS
from .speed import CPU_LAYERS, build_pair, narrow
from ..generation.chat import ChatEngine
from ..config import ModelConfig
from ..processing.processor import Processor


def make_processor(vocab_size: int, small: bool = True) -> Processor:
    """The tiny Gemma-style tokenizer and the published chat template of E2B/E4B (``small``) or
    26B/31B (random weights need no real vocabulary)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from ..processing.processor import published_chat_template
    from ..testing import write_tokenizer

    with tempfile.TemporaryDirectory(prefix="gemma4-bench-") as folder:
        write_tokenizer(Path(folder), chat_template=published_chat_template(small))
        tokenizer = load_tokenizer(Path(folder))
    config = ModelConfig.from_dict({"model_type": "gemma4_text", "vocab_size": vocab_size})
    return Processor(tokenizer, config, eos_token_ids=[1, 106])


def filler(processor: Processor, tokens: int) -> str:
    """A user message of about ``tokens`` tokens."""
    words = "the water of the world is one long day for people who write about time ".split()
    text, n = [], 0
    while n < tokens:
        text.append(words[len(text) % len(words)])
        n = len(processor.encode(" ".join(text), add_special_tokens=False))
    return " ".join(text)


def text_sampler(processor: Processor, vocab_size: int):
    """Sampling over the tokenizer's ordinary tokens only: random weights over the model's 262144 ids
    would mostly pick ids the tiny tokenizer cannot show (and greedy, whitespace), while a reply needs
    text to come back in the next turn (the engine then reuses the ids it generated)."""
    hf = processor.tokenizer._tokenizer
    special = [i for i, t in hf.added_tokens_decoder.items() if t.special]
    allowed = mx.zeros((vocab_size,)).at[mx.array(special)].add(-mx.inf).at[len(processor.tokenizer) :].add(-mx.inf)
    mx.eval(allowed)
    return lambda logprobs: mx.random.categorical(logprobs + allowed)


def second_turn(engine: ChatEngine, processor: Processor, history_tokens: int, new_tokens: int, reply_tokens: int):
    """Stats of the second turn with reuse, then of the same turn from a fresh cache."""
    first = [{"role": "user", "content": filler(processor, history_tokens)}]
    sampler = text_sampler(processor, engine.model.text_config.vocab_size)
    reply = list(engine.stream(first, max_tokens=reply_tokens, sampler=sampler, seed=0))[-1].reply
    second = first + [reply.as_message(), {"role": "user", "content": filler(processor, new_tokens)}]
    with_reuse = list(engine.stream(second, max_tokens=2, sampler=sampler))[-1].stats
    fresh = list(engine.stream(second, max_tokens=2, sampler=sampler, reuse=False))[-1].stats
    return with_reuse, fresh


def decode_speed(engine: ChatEngine, theirs, processor: Processor, tokens: int) -> tuple[float, float]:
    """Generation tok/s of a ``tokens``-token reply: the engine's, then mlx-lm's ``stream_generate``
    on the same prompt with the same sampler (one token sampled ahead, as both report it)."""
    from mlx_lm import stream_generate

    messages = [{"role": "user", "content": filler(processor, 32)}]
    sampler = text_sampler(processor, engine.model.text_config.vocab_size)
    ours = list(engine.stream(messages, max_tokens=tokens, sampler=sampler, seed=0))[-1].stats.generation_tps
    prompt = processor.prepare(messages)["input_ids"][0].tolist()
    mlx_lm = list(stream_generate(theirs, processor.tokenizer, prompt, max_tokens=tokens, sampler=sampler))[-1].generation_tps
    return ours, mlx_lm


def main(argv: list[str] | None = None) -> None:
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    p = argparse.ArgumentParser(prog="python -m gemma4_mlx.bench.chat", description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="e2b", choices=list(VARIANTS))
    p.add_argument("--layers", default=None, help="layers ('full' for all; default: full on a GPU, fewer on a CPU)")
    p.add_argument("--bits", type=int, default=4 if on_gpu else 0, help="quantization bits (0: unquantized)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--history", type=int, nargs="+", default=[4096, 16384] if on_gpu else [128, 512])
    p.add_argument("--new", type=int, default=32, help="tokens in the second message")
    p.add_argument("--reply", type=int, default=16, help="tokens of the first reply")
    p.add_argument("--vocab", type=int, default=262_144)
    p.add_argument("--narrow", action="store_true", help="small widths, same layers: decoding then costs mostly the building of each step's graph")
    p.add_argument("--decode", type=int, default=64, help="tokens of the reply whose decoding speed is compared with mlx-lm's")
    args = p.parse_args(argv)

    layers = None if args.layers == "full" or (args.layers is None and on_gpu) else int(args.layers or CPU_LAYERS[args.variant])
    edit = narrow if args.narrow else None
    model, theirs, text = build_pair(args.variant, layers, args.bits or None, getattr(mx, args.dtype), args.vocab, edit=edit)
    processor = make_processor(text["vocab_size"], small=args.variant in ("e2b", "e4b"))
    engine = ChatEngine(model, processor)
    second_turn(engine, processor, 16, 4, 2)  # warm up
    print(f"device: {mx.default_device()}, mlx {mx.__version__}, {args.variant} ({text['num_hidden_layers']} layers), "
          f"{f'{args.bits}-bit' if args.bits else args.dtype}{', narrow widths' if args.narrow else ''}; second message {args.new} tokens, first reply {args.reply}")  # fmt: skip
    print("| history tokens | 2nd-turn prompt | reused | prefilled (reuse / fresh) | time to first token (reuse / fresh / ratio) |")
    print("|---|---|---|---|---|")
    for n in args.history:
        a, b = second_turn(engine, processor, n, args.new, args.reply)
        print(
            f"| {n} | {a.prompt_tokens} | {a.reused_tokens} | {a.prompt_tokens - a.reused_tokens} / {b.prompt_tokens} "
            f"| {a.time_to_first_token:.3f} s / {b.time_to_first_token:.3f} s / {b.time_to_first_token / a.time_to_first_token:.1f}x |",
            flush=True,
        )
    decode_speed(engine, theirs, processor, 4)  # warm up
    ours, mlx_lm = decode_speed(engine, theirs, processor, args.decode)
    print(f"\n| reply decoding, {args.decode} tokens | ours (ChatEngine) | mlx-lm (stream_generate) | ratio |")
    print("|---|---|---|---|")
    print(f"| tok/s | {ours:.1f} | {mlx_lm:.1f} | {ours / mlx_lm:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
