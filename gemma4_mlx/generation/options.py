"""Generation options: one dataclass for every entry point (``stream_generate``, ``ChatEngine``,
``Chat``, the command line), checked once where they enter, so that a bad value fails with the
option's name and allowed range rather than deep inside MLX or, worse, silently (a NaN temperature
samples garbage); and the sampler and logits processors they make (mlx-lm's)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from ..errors import OptionError
from ..models.cache import KV_BITS, KV_GROUP_SIZES
from ..processing.image import SUPPORTED_SOFT_TOKENS

MAX_SEED = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit integer


def _integer(name: str, value: Any, low: int, high: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    ok = isinstance(value, Integral) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    if not ok:
        allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
        raise OptionError(f"{name} must be {allowed}{' or None' if optional else ''}, not {value!r}")


def _real(name: str, value: Any, low: float, high: float | None, low_open: bool = False, optional: bool = False) -> None:
    if value is None and optional:
        return
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (high is None or value <= high)
    if not ok:
        bracket = "(" if low_open else "["
        allowed = f"a number in {bracket}{low:g}, {high:g}]" if high is not None else f"a number {'>' if low_open else '>='} {low:g}"
        raise OptionError(f"{name} must be {allowed}{' or None' if optional else ''}, not {value!r}")


def check_generation_options(
    max_tokens: Any = 1,
    temperature: Any = 0.0,
    top_p: Any = 1.0,
    top_k: Any = 0,
    min_p: Any = 0.0,
    repetition_penalty: Any = None,
    repetition_context_size: Any = 20,
    seed: Any = None,
    prefill_step_size: Any = 2048,
    max_soft_tokens: Any = None,
    kv_bits: Any = None,
    kv_group_size: Any = 64,
) -> None:
    """Raise :class:`~gemma4_mlx.errors.OptionError` naming the first option outside its range."""
    _integer("max_tokens", max_tokens, 1)
    _real("temperature", temperature, 0.0, None)
    _real("top_p", top_p, 0.0, 1.0, low_open=True)
    _integer("top_k", top_k, 0)
    _real("min_p", min_p, 0.0, 1.0)
    _real("repetition_penalty", repetition_penalty, 0.0, None, low_open=True, optional=True)
    _integer("repetition_context_size", repetition_context_size, 1)
    _integer("seed", seed, 0, MAX_SEED, optional=True)
    _integer("prefill_step_size", prefill_step_size, 1)
    if max_soft_tokens is not None and max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
        raise OptionError(f"max_soft_tokens (the image token budget) must be one of {SUPPORTED_SOFT_TOKENS} or None, not {max_soft_tokens!r}")
    if kv_bits is not None and (isinstance(kv_bits, bool) or kv_bits not in KV_BITS):
        raise OptionError(f"kv_bits (the KV cache's bits per value) must be one of {', '.join(map(str, KV_BITS))} or None (unquantized), not {kv_bits!r}")
    if isinstance(kv_group_size, bool) or kv_group_size not in KV_GROUP_SIZES:
        raise OptionError(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, not {kv_group_size!r}")


@dataclass
class GenerationOptions:
    """How to generate: limits, sampling (greedy at ``temperature=0``, else mlx-lm's sampler with
    top-p, top-k and min-p), the repetition penalty, the seed, thinking, the image token budget and
    the KV cache's quantization."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    seed: int | None = None
    enable_thinking: bool = False
    max_soft_tokens: int | None = None  # image token budget: 70, 140, 280 (default), 560, 1120
    prefill_step_size: int = 2048
    kv_bits: int | None = None  # quantized KV cache: 8 or 4 bits per value (None: the model's dtype)
    kv_group_size: int = 64  # values sharing a scale and bias in the quantized KV cache
    sampler: Callable[[mx.array], mx.array] | None = None  # replaces the one made from the options above
    logits_processors: list[Callable] | None = None  # run after the repetition penalty

    def __post_init__(self):
        check_generation_options(
            self.max_tokens, self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty,
            self.repetition_context_size, self.seed, self.prefill_step_size, self.max_soft_tokens, self.kv_bits,
            self.kv_group_size,
        )  # fmt: skip

    def make_sampler(self) -> Callable[[mx.array], mx.array]:
        return self.sampler or make_sampler(temp=self.temperature, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)

    def make_distribution(self) -> Callable[[mx.array], mx.array] | None:
        """The distribution the sampler draws from, as log-probabilities: ``logprobs -> logprobs``
        after mlx-lm's top-p, min-p and top-k filters and the temperature, in mlx-lm's order (None
        when greedy). Speculative sampling needs it to accept drafted tokens exactly."""
        if self.temperature == 0:
            return None
        top_p, min_p, top_k, temp = self.top_p, self.min_p, self.top_k, self.temperature

        def distribution(logprobs: mx.array) -> mx.array:
            if 0 < top_p < 1.0:
                logprobs = apply_top_p(logprobs, top_p)
            if min_p != 0.0:
                logprobs = apply_min_p(logprobs, min_p)
            if top_k > 0:
                logprobs = apply_top_k(logprobs, top_k)
            scaled = logprobs * (1.0 / temp)
            return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)

        return distribution

    def make_logits_processors(self) -> list[Callable]:
        penalty = make_logits_processors(
            repetition_penalty=self.repetition_penalty, repetition_context_size=self.repetition_context_size
        )
        return penalty + list(self.logits_processors or [])
