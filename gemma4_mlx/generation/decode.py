"""Prefill and the decode loop: the model's side of generation, shared by every entry point.

The loop is our own (so prompts can be prefilled in chunks, from precomputed multimodal embeddings
and reused caches); the sampler and logits processors around it are mlx-lm's.
"""

from __future__ import annotations

from typing import Any, Callable, Generator

import mlx.core as mx
import numpy as np

# Generation runs on a stream of its own, one per thread (MLX streams and the arrays in flight on
# them belong to the thread that made them).
GENERATION_STREAM = mx.new_thread_local_stream(mx.default_device())


def prefill(
    model,
    tokens,
    cache: list,
    step_size: int = 2048,
    progress: Callable[[int, int], Any] | None = None,
    inputs_embeds: mx.array | None = None,
    vision_blocks: np.ndarray | None = None,
    stop: Callable[[], bool] | None = None,
) -> int:
    """Run ``tokens`` [L] through the model in chunks of at most ``step_size``, filling ``cache``.

    Only the cache states are evaluated, so MLX never computes the chunks' logits (nor the KV-shared
    layers, which write no cache). ``inputs_embeds`` [L, hidden] replace the token embeddings (media
    merged in); ``vision_blocks`` [L] (image-block ids, -1 for text, from ``model.vision_block_ids``)
    make image blocks bidirectional, and chunks never cut through one. ``stop()`` is asked after
    each chunk. Returns how many tokens went into the cache (fewer than L when stopped).
    """
    tokens = mx.array(tokens)
    total, done = tokens.size, 0
    while done < total:
        if done and stop is not None and stop():  # between chunks (at least one runs)
            break
        n = min(step_size, total - done)
        if vision_blocks is not None:
            n = _chunk_end(vision_blocks[done:], n)
        model.forward(
            tokens[None, done : done + n],
            cache,
            inputs_embeds=None if inputs_embeds is None else inputs_embeds[None, done : done + n],
            vision_blocks=None if vision_blocks is None else vision_blocks[None, done : done + n],
        )
        mx.eval([c.state for c in cache])
        done += n
        if progress:
            progress(done, total)
        mx.clear_cache()
    return done


def _chunk_end(blocks: np.ndarray, n: int) -> int:
    """Move a chunk end of ``n`` tokens out of an image block: back to its start, or, for a block
    longer than the chunk, forward to its end."""
    b = blocks[n - 1]
    if b < 0 or n >= len(blocks) or blocks[n] != b:
        return n
    start = n - 1
    while start > 0 and blocks[start - 1] == b:
        start -= 1
    if start > 0:
        return start
    end = n
    while end < len(blocks) and blocks[end] == b:
        end += 1
    return end


def processed_logprobs(logits: mx.array, processors: list[Callable] | None, context: mx.array) -> mx.array:
    """Log-probabilities of the token after ``context``: the logits processors (mlx-lm's repetition
    penalty and the caller's), then normalised."""
    for proc in processors or ():
        logits = proc(context, logits)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


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
    vision_blocks: np.ndarray | None = None,
) -> Generator[tuple[int, mx.array], None, None]:
    """Yield ``(token, logprobs)`` pairs: prefill ``prompt`` [L] into ``cache``, then decode.

    ``inputs_embeds`` [L, hidden] are the prompt's embeddings with media merged in (computed once by
    ``model.embed_multimodal``) and ``vision_blocks`` [L] its image blocks (see :func:`prefill`);
    decode steps embed their tokens themselves. ``history`` is what the logits processors see as the
    context before the first new token (default: ``prompt``), for callers that prefilled part of the
    prompt themselves.

    The next token is computed asynchronously while the caller handles the current one, so the
    decode loop never waits on the host (the same pipelining as mlx-lm's ``generate_step``).
    """
    history = prompt if history is None else history

    def step(tokens: mx.array, embeds: mx.array | None = None):
        nonlocal history
        logits = model.forward(tokens[None], cache, inputs_embeds=None if embeds is None else embeds[None])[:, -1, :]
        logprobs = processed_logprobs(logits, logits_processors, history)
        token = sampler(logprobs)
        if logits_processors:
            history = mx.concatenate([history, token])
        return token, logprobs.squeeze(0)

    if max_tokens <= 0:
        return
    prompt = mx.array(prompt)
    with mx.stream(GENERATION_STREAM):
        # All but the last prompt token fill the cache; the last one's logits give the first new token.
        blocks = None if vision_blocks is None else vision_blocks[:-1]
        prefill(model, prompt[:-1], cache, prefill_step_size, prompt_progress, inputs_embeds, blocks)
        token, logprobs = step(prompt[-1:], None if inputs_embeds is None else inputs_embeds[-1:])
        mx.async_eval(token, logprobs)
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            with mx.stream(GENERATION_STREAM):
                next_token, next_logprobs = step(token)
                mx.async_eval(next_token, next_logprobs)
        yield token.item(), logprobs
        if n + 1 < max_tokens:
            token, logprobs = next_token, next_logprobs
        if n % 256 == 255:
            mx.clear_cache()
