"""Compiled functions that can be let go of: ``compiled(fn)`` is ``mx.compile(fn)``, made on first
call, remade after :func:`reset` (when what the ops call changes), and freed at interpreter exit.

Why this care: MLX keeps a compiled function's traces in a cache *per thread*, and a trace holds
Python objects, so dropping it takes the GIL. Two ways that goes wrong at exit, both ending in
"terminate called without an active exception":

- Module-level compiled functions live until MLX's static destruction, after Python has finalized.
  Freeing them in an ``atexit`` hook (after the engine's threads are joined, whose hooks run first)
  avoids it.
- A thread that ran compiled functions (the chat engine's) frees its cache in a thread-local
  destructor *after* ``Thread.join`` has returned. If the interpreter is finalizing by then, taking
  the GIL ends the thread inside that destructor and the process aborts. Such a thread calls
  :func:`release_thread` as its last step, which empties its cache while it still holds the GIL.
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


def release_thread(*streams) -> None:
    """Let go of what MLX keeps for the calling thread (its compiled traces, its streams), as the
    last step of a thread that ran model work; see the module docstring. The work queued on
    ``streams`` (and the default stream) finishes first, as their command encoders go."""
    for stream in (None, *streams):
        mx.synchronize(stream)
    mx.clear_streams()
