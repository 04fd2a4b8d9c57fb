"""Streaming generation for one prompt: ``stream_generate`` and ``generate``.

mlx-lm's streaming detokenizers turn the tokens into text (they hold back incomplete UTF-8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator

import mlx.core as mx
from mlx_lm.generate import wired_limit

from ..distributed.lockstep import Lockstep, fresh_seed, peers_watched
from ..distributed.traffic import Traffic
from ..errors import OptionError
from ..memory import check_fits
from ..models.cache import kv_quantization
from .decode import GENERATION_STREAM, generate_tokens
from .options import GenerationOptions
from .pipeline import Timing, prepare_request
from .speculative import DEFAULT_DRAFT_TOKENS, SpeculativeStats, load_checked_drafter, speculative_tokens


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
    draft: SpeculativeStats | None = None  # with a draft model: acceptance so far
    traffic: Traffic | None = None  # a sharded model: what this process exchanged with the others so far

    def summary(self) -> str:
        """One line of statistics (the command line prints it after the text)."""
        draft = traffic = ""
        if self.draft is not None:
            d = self.draft
            draft = f" | drafts: {d.accepted}/{d.drafted} accepted ({d.acceptance_rate:.0%}), {d.tokens_per_step:.2f} tokens per target step"
        if self.traffic is not None:
            traffic = f" | communication: {self.traffic.summary()}"
        return (
            f"prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.1f} tok/s | generation: {self.generation_tokens} "
            f"tokens, {self.generation_tps:.1f} tok/s{draft} | peak memory {self.peak_memory:.2f} GB{traffic} | finish: {self.finish_reason}"
        )


def stream_generate(
    model,
    processor,
    prompt: str | list[dict[str, Any]] | list[int],
    *,
    cache: list | None = None,
    prompt_progress: Callable[[int, int], Any] | None = None,
    images=None,
    audio=None,
    videos=None,
    draft_model=None,
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    **options,
) -> Generator[GenerationChunk, None, None]:
    """Generate text token by token.

    ``prompt`` is a raw string (sent as is), a list of chat messages (rendered with the checkpoint's
    chat template; their text is plain text) or a list of token ids. ``options`` are the fields of
    :class:`~gemma4_mlx.generation.options.GenerationOptions`: ``max_tokens`` (256), ``temperature``
    (0: greedy), ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``repetition_context_size``,
    ``seed``, ``enable_thinking``, ``max_soft_tokens`` (the image token budget), ``prefill_step_size``,
    ``kv_bits`` and ``kv_group_size`` (a quantized KV cache, for long contexts), ``sampler`` and
    ``logits_processors``. Generation stops at the model's end tokens (``<eos>``,
    ``<turn|>``) or after ``max_tokens``. Pass ``cache`` to continue from an earlier prompt (it is
    updated in place, and its own quantization applies); ``prompt_progress(done, total)`` is called after each prefill chunk.

    Media come as ``{"type": "image" | "audio" | "video", ...}`` items of chat messages, or as
    ``images``/``audio``/``videos`` lists matching the prompt's placeholders. The encoders run once,
    before the prompt is prefilled.

    ``draft_model`` (a Gemma 4 assistant: a folder, a Hub id such as
    ``"google/gemma-4-E2B-it-assistant"``, or a drafter from :func:`~gemma4_mlx.load_drafter`)
    turns on speculative decoding with ``num_draft_tokens`` drafted tokens per target step; the
    output is what the target alone would give (the same greedy tokens, the same distribution when
    sampling). Chunks then carry ``draft`` statistics.
    """
    opts = GenerationOptions(**options)
    if opts.seed is None and opts.temperature > 0 and getattr(model, "group", None) is not None:
        # A sharded model: every process runs this call and must draw the same samples.
        opts.seed = Lockstep(model.group, model.watchdog, model.traffic).leaders(fresh_seed())
    drafter = _drafter(draft_model, model, opts, num_draft_tokens)
    cached = cache[0].offset if cache else 0
    request = prepare_request(model, processor, prompt, opts, cached, images, audio, videos)
    ids = request.ids
    if cache is None:
        slack = 1 if drafter is not None else 0
        cache = model.make_cache(sliding_slack=slack, kv_bits=opts.kv_bits, kv_group_size=opts.kv_group_size)
    check_fits(model, cached + len(ids) + request.max_tokens, cache, opts.prefill_step_size, *kv_quantization(cache))
    inputs_embeds = model.embed_multimodal(mx.array(ids), **request.media)[0] if request.media else None

    # On Apple silicon the weights stay wired (resident) while generating, as in mlx-lm.
    with wired_limit(model, [GENERATION_STREAM]):
        yield from _stream_chunks(model, ids, cache, request, opts, drafter, num_draft_tokens, prompt_progress, inputs_embeds, processor)


def _stream_chunks(model, ids, cache, request, opts, drafter, num_draft_tokens, prompt_progress, inputs_embeds, processor):
    eos = processor.eos_token_ids
    detokenizer = processor.detokenizer
    detokenizer.reset()
    timing = Timing(prefilled=len(ids))
    stats = None
    if drafter is None:
        tokens = generate_tokens(
            model, mx.array(ids), cache, request.max_tokens, request.sampler, request.logits_processors,
            opts.prefill_step_size, prompt_progress, inputs_embeds, vision_blocks=request.vision_blocks,
        )  # fmt: skip
    else:
        stats = SpeculativeStats()
        tokens = speculative_tokens(
            model, drafter, mx.array(ids), cache, request.max_tokens, request.sampler, request.logits_processors,
            opts.make_distribution(), num_draft_tokens, opts.prefill_step_size, prompt_progress, inputs_embeds,
            vision_blocks=request.vision_blocks, stats=stats,
        )  # fmt: skip
    traffic = model.traffic.copy() if getattr(model, "traffic", None) is not None else None
    with peers_watched(getattr(model, "group", None)):  # a sharded model: a peer gone is said plainly
        for tok, logprobs in tokens:
            timing.token()
            finish = None
            if tok in eos:
                finish = "stop"
            else:
                detokenizer.add_token(tok)
                if timing.tokens == request.max_tokens:
                    finish = "length"
            if finish:
                detokenizer.finalize()
            if getattr(model, "watchdog", None) is not None:  # several processes: this token's pass is done
                model.watchdog.idle()  # and the caller may take its time
            yield GenerationChunk(
                text=detokenizer.last_segment,
                token=tok,
                finish_reason=finish,
                prompt_tokens=len(ids),
                prompt_tps=timing.prompt_tps,
                generation_tokens=timing.tokens,
                generation_tps=timing.generation_tps,
                peak_memory=timing.peak_memory,
                logprobs=logprobs,
                draft=stats,
                traffic=None if traffic is None else model.traffic.since(traffic),
            )
            if finish:
                return


def _drafter(draft_model, model, opts: GenerationOptions, num_draft_tokens):
    if draft_model is not None and opts.sampler is not None:
        raise OptionError("a custom sampler cannot be used with a draft model: accepting drafted tokens needs the distribution it draws from")
    return load_checked_drafter(draft_model, model, num_draft_tokens)


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
        print(last.summary())
    return "".join(text)
