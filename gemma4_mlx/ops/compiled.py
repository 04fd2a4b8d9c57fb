"""Compiled functions that can be let go of: ``compiled(fn)`` is ``mx.compile(fn)``, made on first
call, remade after :func:`reset` (when what the ops call changes), and freed at interpreter exit.

Why not plain ``mx.compile`` at module level: MLX keeps a compiled function's traces until the
function object is freed. Module-level compiled functions live until MLX's own static destruction,
and if a trace was made on another thread (the chat engine's worker, with its thread-local stream)
destroying it then aborts the process ("terminate called without an active exception"). Freeing the
traces in an ``atexit`` hook (after the engine's threads are joined, whose hooks run first) avoids it.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Callable

import mlx.core as mx

_LIVE: list[weakref.ref] = []
_generation = 0


class Compiled:
    """``mx.compile(fn, **options)``, made lazily; see the module docstring."""

    def __init__(self, fn: Callable, **options):
        self.fn, self.options, self._impl, self._made_at = fn, options, None, -1
        _LIVE.append(weakref.ref(self))

    def __call__(self, *args):
        if self._impl is None or self._made_at != _generation:
            self._impl, self._made_at = mx.compile(self.fn, **self.options), _generation
        return self._impl(*args)

    def free(self) -> None:
        self._impl = None


def compiled(fn: Callable | None = None, **options):
    """Decorator or function: ``compiled(fn, inputs=..., shapeless=...)`` or ``@compiled``."""
    if fn is None:
        return lambda f: Compiled(f, **options)
    return Compiled(fn, **options)


def reset() -> None:
    """Make every compiled function trace again on its next call."""
    global _generation
    _generation += 1


@atexit.register
def _free_all() -> None:
    for ref in _LIVE:
        c = ref()
        if c is not None:
            c.free()
