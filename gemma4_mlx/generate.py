"""Streaming generation and the ``python -m gemma4_mlx.generate`` command line.

The loop is our own (so prompts can be prefilled in chunks and, later, start from precomputed
multimodal embeddings and reused caches); the parts around it are mlx-lm's: its sampler and
logits processors, and its streaming detokenizers, which hold back incomplete UTF-8.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Generator

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from .errors import ContextLengthError
from .model import check_token_ids
from .options import check_generation_options

_thread_streams = threading.local()


def generation_stream() -> mx.Stream:
    """This thread's stream for generation (MLX streams belong to the thread that made them)."""
    stream = getattr(_thread_streams, "stream", None)
    if stream is None:
        stream = _thread_streams.stream = mx.new_stream(mx.default_device())
    return stream


# `python -m gemma4_mlx.generate` runs this file after the package has imported it (gemma4_mlx
# re-exports generate/stream_generate), so runpy warns on every run of the command line. Running
# the module body twice is harmless here; silence just that warning.
warnings.filterwarnings("ignore", message=r"'gemma4_mlx\.generate' found in sys\.modules", category=RuntimeWarning)


@dataclass
class GenerationChunk:
    """One step of :func:`stream_generate`."""

    text: str  # new text since the previous chunk (may be empty while UTF-8 is incomplete)
    token: int
    finish_reason: str | None  # None while generating, then "stop" (end token) or "length"
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    logprobs: mx.array | None = None


def prefill(
    model,
    tokens: mx.array,
    cache: list,
    step_size: int = 2048,
    progress: Callable[[int, int], Any] | None = None,
    inputs_embeds: mx.array | None = None,
) -> tuple[mx.array, mx.array | None]:
    """Run all but the last of ``tokens`` [L] through the model in chunks, filling ``cache``.

    Returns the last token (and its embedding, with ``inputs_embeds`` [L, hidden]). Only the cache
    states are evaluated, so MLX never computes the chunks' logits (nor the KV-shared layers, which
    write no cache). Chunks never cut through an image block, which must see itself whole.
    """
    total = tokens.size
    blocks = model.vision_block_ids(np.array(tokens)[None])
    done = 0
    while tokens.size > 1:
        n = min(step_size, tokens.size - 1)
        if blocks is not None:
            n = _chunk_end(blocks[0, done:], n)
        embeds = inputs_embeds[None, :n] if inputs_embeds is not None else None
        model(tokens[None, :n], cache=cache, inputs_embeds=embeds)
        mx.eval([c.state for c in cache])
        tokens = tokens[n:]
        inputs_embeds = inputs_embeds[n:] if inputs_embeds is not None else None
        done += n
        if progress:
            progress(done, total)
        mx.clear_cache()
    return tokens, inputs_embeds


def _chunk_end(blocks: np.ndarray, n: int) -> int:
    """Move a chunk end of ``n`` tokens out of an image block: back to its start, or, for a block
    longer than the chunk, forward to its end (one token is always left for the final step)."""
    b = blocks[n - 1]
    if b < 0 or n >= len(blocks) or blocks[n] != b:
        return n
    start = n - 1
    while start > 0 and blocks[start - 1] == b:
        start -= 1
    if start > 0:
        return start
    end = n
    while end < len(blocks) - 1 and blocks[end] == b:
        end += 1
    return end


def generate_tokens(
    model,
    prompt: mx.array,
    cache: list,
    max_tokens: int,
    sampler: Callable[[mx.array], mx.array],
    logits_processors: list[Callable] | None = None,
    prefill_step_size: int = 2048,
    prompt_progress: Callable[[int, int], Any] | None = None,
    inputs_embeds: mx.array | None = None,
    history: mx.array | None = None,
) -> Generator[tuple[int, mx.array], None, None]:
    """Yield ``(token, logprobs)`` pairs: prefill ``prompt`` [L] into ``cache``, then decode.

    ``inputs_embeds`` [L, hidden] are the prompt's embeddings with media merged in (computed once by
    ``model.embed_multimodal``); decode steps embed their tokens themselves. ``history`` is what the
    logits processors see as the context before the first new token (default: ``prompt``), for
    callers that prefilled part of the prompt themselves.

    The next token is computed asynchronously while the caller handles the current one, so the
    decode loop never waits on the host (the same pipelining as mlx-lm's ``generate_step``).
    """
    history = prompt if history is None else history

    def step(tokens: mx.array, embeds: mx.array | None = None):
        nonlocal history
        logits = model(tokens[None], cache=cache, inputs_embeds=None if embeds is None else embeds[None])[:, -1, :]
        if logits_processors:
            for proc in logits_processors:
                logits = proc(history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = sampler(logprobs)
        if logits_processors:
            history = mx.concatenate([history, token])
        return token, logprobs.squeeze(0)

    if max_tokens <= 0:
        return
    stream = generation_stream()
    with mx.stream(stream):
        last, last_embeds = prefill(model, prompt, cache, prefill_step_size, prompt_progress, inputs_embeds)
        token, logprobs = step(last, last_embeds)
        mx.async_eval(token, logprobs)
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            with mx.stream(stream):
                next_token, next_logprobs = step(token)
                mx.async_eval(next_token, next_logprobs)
        yield token.item(), logprobs
        if n + 1 < max_tokens:
            token, logprobs = next_token, next_logprobs
        if n % 256 == 255:
            mx.clear_cache()


def stream_generate(
    model,
    processor,
    prompt: str | list[dict[str, Any]] | list[int],
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    repetition_context_size: int = 20,
    seed: int | None = None,
    enable_thinking: bool = False,
    cache: list | None = None,
    prefill_step_size: int = 2048,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: list[Callable] | None = None,
    prompt_progress: Callable[[int, int], Any] | None = None,
    images=None,
    audio=None,
    videos=None,
    max_soft_tokens: int | None = None,
) -> Generator[GenerationChunk, None, None]:
    """Generate text token by token.

    ``prompt`` is a raw string, a list of chat messages (rendered with the checkpoint's chat
    template; ``enable_thinking`` turns reasoning on) or a list of token ids. Sampling is greedy
    at ``temperature=0``; otherwise temperature, top-p, top-k and min-p apply (mlx-lm's sampler).
    Generation stops at the model's end tokens (``<eos>``, ``<turn|>``) or after ``max_tokens``.
    Pass ``cache`` to continue from an earlier prompt (it is updated in place).

    Media come as ``{"type": "image" | "audio" | "video", ...}`` items of chat messages, or as
    ``images``/``audio``/``videos`` lists matching the prompt's placeholders; ``max_soft_tokens`` is
    the image token budget. The encoders run once, before the prompt is prefilled.
    """
    check_generation_options(
        max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size, seed,
        prefill_step_size, max_soft_tokens,
    )  # fmt: skip
    inputs = processor.prepare(prompt, images, audio, videos, enable_thinking=enable_thinking, max_soft_tokens=max_soft_tokens)
    ids_array = inputs.pop("input_ids")[0]
    ids = ids_array.tolist()
    media = {k: v for k, v in inputs.items() if v is not None}
    inputs_embeds = model.embed_multimodal(ids_array, **media)[0] if media else None
    check_token_ids(model.text_token_ids(ids_array), model.text_config.vocab_size)
    context = model.text_config.max_position_embeddings
    start = cache[0].offset if cache else 0
    if start + len(ids) >= context:
        raise ContextLengthError(
            f"prompt of {len(ids)} tokens{f' after {start} cached' if start else ''} does not fit the "
            f"model's context of {context} tokens"
        )
    max_tokens = min(max_tokens, context - start - len(ids))
    if seed is not None:
        mx.random.seed(seed)
    sampler = sampler or make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k)
    # The repetition penalty applies with or without custom processors, which run after it.
    logits_processors = make_logits_processors(
        repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size
    ) + list(logits_processors or [])
    cache = cache if cache is not None else model.make_cache()
    eos = processor.eos_token_ids
    detokenizer = processor.detokenizer
    detokenizer.reset()

    mx.reset_peak_memory()
    tic = time.perf_counter()
    prompt_tps = gen_tic = None
    tokens = generate_tokens(
        model, ids_array, cache, max_tokens, sampler, logits_processors, prefill_step_size, prompt_progress, inputs_embeds
    )
    for n, (tok, logprobs) in enumerate(tokens, start=1):
        if n == 1:
            prompt_tps = len(ids) / (time.perf_counter() - tic)
            gen_tic = time.perf_counter()
        finish = None
        if tok in eos:
            finish = "stop"
            detokenizer.finalize()
        else:
            detokenizer.add_token(tok)
            if n == max_tokens:
                finish = "length"
                detokenizer.finalize()
        elapsed = time.perf_counter() - gen_tic
        yield GenerationChunk(
            text=detokenizer.last_segment,
            token=tok,
            finish_reason=finish,
            prompt_tokens=len(ids),
            prompt_tps=prompt_tps,
            generation_tokens=n,
            generation_tps=(n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            logprobs=logprobs,
        )
        if finish:
            return


def generate(model, processor, prompt, verbose: bool = False, **kwargs) -> str:
    """Generate and return the whole text (see :func:`stream_generate` for the options)."""
    text = []
    last = None
    for chunk in stream_generate(model, processor, prompt, **kwargs):
        text.append(chunk.text)
        last = chunk
        if verbose:
            print(chunk.text, end="", flush=True)
    if verbose and last is not None:
        print()
        print(_stats_line(last))
    return "".join(text)


def _stats_line(c: GenerationChunk) -> str:
    return (
        f"prompt: {c.prompt_tokens} tokens, {c.prompt_tps:.1f} tok/s | generation: {c.generation_tokens} tokens, "
        f"{c.generation_tps:.1f} tok/s | peak memory {c.peak_memory:.2f} GB | finish: {c.finish_reason}"
    )


def _read_stdin() -> str:
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"standard input is not UTF-8 text (byte {e.start} of {len(data)}); convert it first, e.g. with iconv") from None


def main(argv: list[str] | None = None) -> int:
    from .loading import load

    p = argparse.ArgumentParser(prog="python -m gemma4_mlx.generate", description="Generate text with Gemma 4 on MLX.")
    p.add_argument("--model", required=True, help="local folder (HF or converted) or Hub repo id")
    p.add_argument("--prompt", required=True, help="the user message ('-' reads standard input)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--image", action="append", default=[], help="an image file (repeatable)")
    p.add_argument("--audio", action="append", default=[], help="an audio file (repeatable; E2B/E4B)")
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
    p.add_argument("--quiet", action="store_true", help="print only the generated text")
    args = p.parse_args(argv)

    try:
        text = _read_stdin() if args.prompt == "-" else args.prompt
        check_generation_options(
            args.max_tokens, args.temperature, args.top_p, args.top_k, args.min_p, args.repetition_penalty,
            seed=args.seed, max_soft_tokens=args.image_tokens,
        )  # fmt: skip
        model, processor = load(args.model, dtype=args.dtype)
        if args.raw:
            prompt: Any = text
        else:
            media = [{"type": "image", "path": f} for f in args.image] + [{"type": "audio", "path": f} for f in args.audio]
            media += [{"type": "video", "path": f} for f in args.video]
            content = media + [{"type": "text", "text": text}] if media else text
            prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": content}]
        last = None
        for chunk in stream_generate(
            model,
            processor,
            prompt,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            enable_thinking=args.thinking,
            max_soft_tokens=args.image_tokens,
        ):
            print(chunk.text, end="", flush=True)
            last = chunk
        print()
        if last is not None and not args.quiet:
            print(_stats_line(last), file=sys.stderr)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
