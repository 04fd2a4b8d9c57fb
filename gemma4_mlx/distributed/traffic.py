"""What a process of a sharded model exchanges with the others, for the statistics.

Transfers and bytes are counted exactly, as the forward passes are built (the sends, receives,
gathers and sums of the pipeline and of tensor parallelism). Their time cannot be read off a lazy,
asynchronous graph without host syncs that would slow every step, so it is estimated from the link:
``transfers x latency + bytes / bandwidth``, both measured once when the model loads
(:func:`measure_link`: small and large ``all_sum``s between the processes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import mlx.core as mx


@dataclass
class Traffic:
    """Transfers and bytes this process moved, and the link's speed to turn them into time."""

    transfers: int = 0
    bytes: int = 0
    latency: float = 0.0  # seconds per transfer (a decode step's all_sum, measured at load)
    bandwidth: float = float("inf")  # bytes per second (a 4 MB all_sum, measured at load)

    def add(self, nbytes: int, transfers: int = 1) -> None:
        self.transfers += transfers
        self.bytes += int(nbytes)

    @property
    def seconds(self) -> float:
        """The time these transfers take on the measured link (an estimate, see the module docstring)."""
        return self.transfers * self.latency + self.bytes / self.bandwidth

    def since(self, earlier: "Traffic") -> "Traffic":
        """What was moved after the snapshot ``earlier`` (a ``copy`` taken then)."""
        return replace(self, transfers=self.transfers - earlier.transfers, bytes=self.bytes - earlier.bytes)

    def copy(self) -> "Traffic":
        return replace(self)

    def summary(self) -> str:
        return f"{self.transfers} transfers, {self.bytes / 1e6:.2f} MB, ~{self.seconds:.3f} s on the link"


def measure_link(group: mx.distributed.Group, width: int, dtype: mx.Dtype = mx.bfloat16, rounds: int = 20) -> tuple[float, float]:
    """``(latency seconds, bandwidth bytes/s)`` of ``group``'s link: the time of an ``all_sum`` of one
    decode step's activations (``width`` values), and the rate of a 4 MB one (the fastest of several)."""
    small, large = mx.zeros((width,), dtype=dtype), mx.zeros((1 << 21,), dtype=mx.float16)

    def timed(x) -> float:
        start = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group, stream=mx.cpu))
        return time.perf_counter() - start

    # The fastest of several: what the link can do (a busy machine only adds to a transfer's time).
    timed(small)  # the first transfer opens the connections
    latency = min(timed(small) for _ in range(rounds))
    seconds = min(timed(large) for _ in range(3))
    return latency, large.nbytes / max(seconds - latency, 1e-9)
