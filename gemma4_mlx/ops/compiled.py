"""Compiled functions that can be let go of: ``compiled(fn)`` is ``mx.compile(fn)``, made on first
call in each thread, remade after :func:`reset` (when what the ops call changes), and freed at exit.

Why this care: MLX keeps compiled traces in a cache *per thread*, and a trace holds Python objects,
so dropping one takes the GIL. A compiled function erases its traces when it is freed, but only
from the cache of the thread that made it. Three ways that went wrong at exit, all ending in
"terminate called without an active exception":

- Module-level compiled functions live until MLX's static destruction, after Python has finalized:
  ours are freed in an ``atexit`` hook instead (after the engine's threads are joined, whose hooks
  run first).
- A function made on one thread and run on another leaves traces the other thread's cache keeps
  until that thread ends: each thread gets its own ``mx.compile`` of the function here.
- A thread that ran compiled functions (the chat engine's) has its cache freed by a thread-local
  destructor *after* ``Thread.join`` has returned; if the interpreter is finalizing by then, taking
  the GIL ends the thread inside that destructor. Such a thread calls :func:`release_thread` as its
  last step, which empties its cache while it still holds the GIL (mlx-lm's samplers, compiled at
  import, leave traces there too).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Callable

import mlx.core as mx

_LIVE: list[weakref.ref] = []
_generation = 0


class Compiled:
    """``mx.compile(fn, **options)``, made lazily in each thread; see the module docstring."""

    def __init__(self, fn: Callable, **options):
        self.fn, self.options = fn, options
        self._impls: dict[int, tuple[Callable, int]] = {}  # thread id -> (mx.compile(fn), generation made at)
        _LIVE.append(weakref.ref(self))

    def __call__(self, *args):
        thread = threading.get_ident()
        impl, made_at = self._impls.get(thread, (None, -1))
        if impl is None or made_at != _generation:
            impl = mx.compile(self.fn, **self.options)
            self._impls[thread] = (impl, _generation)
        return impl(*args)

    def free(self, thread: int | None = None) -> None:
        """Drop the compiled function of ``thread`` (every thread's if None), and with it its traces."""
        if thread is None:
            self._impls.clear()
        else:
            self._impls.pop(thread, None)


def compiled(fn: Callable | None = None, **options):
    """Decorator or function: ``compiled(fn, inputs=..., shapeless=...)`` or ``@compiled``."""
    if fn is None:
        return lambda f: Compiled(f, **options)
    return Compiled(fn, **options)


def reset() -> None:
    """Make every compiled function trace again on its next call."""
    global _generation
    _generation += 1


def _alive() -> list[Compiled]:
    return [c for c in (ref() for ref in _LIVE) if c is not None]


@atexit.register
def _free_all() -> None:
    for c in _alive():
        c.free()


def release_thread(*streams) -> None:
    """Let go of what MLX keeps for the calling thread (its compiled functions and traces, its
    streams), as the last step of a thread that ran model work; see the module docstring. The work
    queued on ``streams`` (and the default stream) finishes first, as their command encoders go."""
    for stream in (None, *streams):
        mx.synchronize(stream)
    thread = threading.get_ident()
    for c in _alive():
        c.free(thread)
    mx.clear_streams()
