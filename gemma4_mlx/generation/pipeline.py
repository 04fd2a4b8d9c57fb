"""The request pipeline: what every entry point does to a prompt before the model runs, and the
timing of a reply. ``stream_generate`` and the chat engine (and the API server) share it.

Everything that needs token values on the host happens here, once per request: the id check, the
context check, the image blocks. The prefill and decode loop then never wait on the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from ..errors import ContextLengthError
from ..models.gemma4 import check_token_ids
from .options import GenerationOptions


@dataclass
class Request:
    """A prompt ready to generate from."""

    ids: list[int]  # the whole prompt (for the chat engine: the whole conversation)
    media: dict[str, mx.array]  # the processor's media arrays for the model (empty for text)
    vision_blocks: np.ndarray | None  # [len(ids)] bidirectional image-block ids (-1: text), or None
    max_tokens: int  # the requested maximum, clamped to the context that is left
    sampler: Callable[[mx.array], mx.array]
    logits_processors: list[Callable]


def prepare_request(
    model, processor, prompt, options: GenerationOptions, cached: int = 0, images=None, audio=None, videos=None, **template
) -> Request:
    """Tokenize ``prompt`` (a string, token ids or chat messages; media from the messages or the
    lists), check its ids against the vocabulary and its length against the context (``cached``
    tokens already precede it in the cache), seed the generator and make the sampler.
    ``template`` goes to the chat template (``tools``, ``replies``; see ``Processor.prepare``)."""
    inputs = processor.prepare(
        prompt, images, audio, videos, enable_thinking=options.enable_thinking, max_soft_tokens=options.max_soft_tokens,
        **template,
    )  # fmt: skip
    ids = inputs.pop("input_ids")[0].tolist()
    host = np.array(ids)
    # Media placeholders may lie outside the text vocabulary: the text model sees the pad id there.
    check_token_ids(np.where(np.isin(host, model.media_token_ids), 0, host), model.text_config.vocab_size)
    context = model.text_config.max_position_embeddings
    if cached + len(ids) >= context:
        raise ContextLengthError(
            f"prompt of {len(ids)} tokens{f' after {cached} cached' if cached else ''} does not fit the "
            f"model's context of {context} tokens"
        )
    if options.seed is not None:
        mx.random.seed(options.seed)
    blocks = model.vision_block_ids(host[None])
    return Request(
        ids=ids,
        media={k: v for k, v in inputs.items() if v is not None},
        vision_blocks=None if blocks is None else blocks[0],
        max_tokens=min(options.max_tokens, context - cached - len(ids)),
        sampler=options.make_sampler(),
        logits_processors=options.make_logits_processors(),
    )


@dataclass
class Timing:
    """Clock of one reply: started when the request arrives, ``token()`` on each generated token.
    Also resets MLX's peak memory, so that ``peak_memory`` is the reply's own."""

    prefilled: int  # prompt tokens actually run through the model (not taken from a cache)
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    tokens: int = 0
    now: float = 0.0

    def __post_init__(self):
        mx.reset_peak_memory()

    def token(self) -> None:
        self.now = time.perf_counter()
        self.tokens += 1
        if self.first is None:
            self.first = self.now

    @property
    def time_to_first_token(self) -> float:
        return (self.first or time.perf_counter()) - self.start

    @property
    def prompt_tps(self) -> float:
        return self.prefilled / self.time_to_first_token if self.time_to_first_token > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        spent = self.now - (self.first or self.now)
        return (self.tokens - 1) / spent if self.tokens > 1 and spent > 0 else 0.0

    @property
    def peak_memory(self) -> float:
        """GB."""
        return mx.get_peak_memory() / 1e9


__all__ = ["Request", "prepare_request", "Timing"]
