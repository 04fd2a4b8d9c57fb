"""Checking generation options once, where they enter the library (``stream_generate``, ``ChatEngine``,
``Chat`` and the command line), so that a bad value fails with the option's name and allowed range
rather than deep inside MLX or, worse, silently (a NaN temperature samples garbage)."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

from .errors import OptionError
from .image_processing import SUPPORTED_SOFT_TOKENS

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
