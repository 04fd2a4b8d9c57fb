"""Bounded waits on the other processes: a process whose peer died or cannot be reached says so and
stops, instead of waiting forever.

Why hand-written: MLX's ring backend blocks without a time limit when a peer is gone (``init``
waits for a peer that never connects; a receive from a dead peer logs "Too many send/recv errors"
and never returns), and ``mlx.launch`` stops the others only when a process exits, which a hung
one never does (nor can a process started by hand count on it).

Two watchers, because ``mx.distributed.init`` holds Python's GIL while it waits (no thread of ours
runs then) but evaluation releases it:

* :func:`connecting` runs a small watcher process around ``init``;
* :class:`Watchdog` is a thread that the pipeline arms at each forward pass and disarms when a
  token is out (or between requests).

The limit: ``GEMMA4_MLX_DISTRIBUTED_TIMEOUT`` seconds (default 120) per step or connection; waiting
for the others to load gets ten times as long, an hour at least (they may be downloading).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

TIMEOUT_VARIABLE = "GEMMA4_MLX_DISTRIBUTED_TIMEOUT"
EXIT_CODE = 75  # EX_TEMPFAIL: a peer, not this process, failed


def default_timeout() -> float:
    """Seconds a step may wait on the other processes (``GEMMA4_MLX_DISTRIBUTED_TIMEOUT``, else 120)."""
    text = os.environ.get(TIMEOUT_VARIABLE, "120")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_VARIABLE} must be a positive number of seconds, not {text!r}")
    return value


_WATCHER = """
import os, select, signal, sys
pid, timeout, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ready, _, _ = select.select([sys.stdin], [], [], timeout)
if not ready:  # the watched process neither finished nor died in time
    sys.stderr.write(message + "\\n")
    sys.stderr.flush()
    os.kill(pid, signal.SIGKILL)
"""


@contextlib.contextmanager
def connecting(timeout: float, message: str):
    """Kill this process, printing ``message``, unless the block ends within ``timeout`` seconds (a
    separate process watches: the block may hold the GIL)."""
    watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, str(os.getpid()), str(timeout), message], stdin=subprocess.PIPE)
    try:
        yield
    finally:
        watcher.stdin.close()  # end of input: the watcher leaves
        watcher.wait()


class Watchdog:
    """Stops this process with a clear message when a step that needs the other processes has not
    finished ``timeout`` seconds after it began (:meth:`expect`); :meth:`idle` ends the watch."""

    def __init__(self, rank: int, size: int, timeout: float | None = None):
        self.rank, self.size = rank, size
        self.timeout = default_timeout() if timeout is None else timeout
        self._deadline: float | None = None
        self._what, self._limit = "", self.timeout
        threading.Thread(target=self._watch, name="gemma4-mlx-watchdog", daemon=True).start()

    def expect(self, what: str, timeout: float | None = None) -> None:
        """A step that waits on the other processes starts now."""
        self._what, self._limit = what, self.timeout if timeout is None else timeout
        self._deadline = time.monotonic() + self._limit

    def idle(self) -> None:
        self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.25)
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                sys.stderr.write(
                    f"error: process {self.rank} of {self.size}: {self._what} got no answer from the other processes in "
                    f"{self._limit:.0f} s; one of them stopped or "
                    f"cannot be reached (its own output says why). Stopping. (The limit is {TIMEOUT_VARIABLE}.)\n"
                )
                sys.stderr.flush()
                os._exit(EXIT_CODE)
