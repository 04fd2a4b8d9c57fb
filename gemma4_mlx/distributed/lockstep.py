"""Serving one sharded model from several processes: process 0 leads, the others follow.

Every process must run the same forward passes in the same order. Under ``mlx.launch`` only process
0 takes requests (the app's page, the API, a script's :class:`~gemma4_mlx.Chat`); its chat engine
hands each request to the others before running it (:meth:`Lockstep.share`: the messages, the
options and the bytes of every image, clip and video, which the others' machines do not have), and
the others run it with their own engine (:meth:`ChatEngine.follow`), so that their prompt caches,
prefix reuse and drafters stay the same as process 0's. Whatever only one process can know is
agreed on at the points where it matters: a stop (a client that went away) at each token and
between prefill chunks (:class:`AgreedStop`), whether the request fits every process's memory, and
which caches to drop. While idle, process 0 sends a heartbeat every quarter of the time limit, so
that a follower whose leader died stops with a message instead of waiting forever.

Built on ``mx.distributed``'s collectives (an ``all_sum`` where only process 0 contributes is a
broadcast); there is no other channel between the processes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import secrets
import tempfile
import threading
from contextlib import ExitStack
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import OptionError, PeerLostError
from .traffic import Traffic

MEDIA_KINDS = ("image", "audio", "video")
MAX_PARTS = 64  # a request's JSON and up to 63 media files


class Lockstep:
    """The channel from process 0 to the others of ``group`` (see the module docstring)."""

    def __init__(self, group: mx.distributed.Group, watchdog=None, traffic: Traffic | None = None):
        self.group, self.watchdog, self.traffic = group, watchdog, traffic
        self.rank, self.size = group.rank(), group.size()
        self.closed = False

    @property
    def leads(self) -> bool:
        return self.rank == 0

    @property
    def heartbeat_interval(self) -> float:
        return self.watchdog.timeout / 4 if self.watchdog is not None else 30.0

    def _sum(self, array: mx.array) -> mx.array:
        return self._collective(mx.distributed.all_sum, array)

    def _collective(self, op, array: mx.array) -> mx.array:
        # On the generation stream, behind the model's own sends and sums: the ring backend pairs
        # each process's transfers in the order they run, and a forward pass may still be in flight.
        from ..generation.decode import GENERATION_STREAM

        out = op(array, group=self.group, stream=GENERATION_STREAM)
        if self.traffic is not None:
            self.traffic.add(out.nbytes)
        with peers_watched(self.group):
            mx.eval(out)
        return out

    def _watched(self, what: str, fn, timeout: float | None = None):
        if self.watchdog is None:
            return fn()
        self.watchdog.expect(what, timeout)
        try:
            return fn()
        finally:
            self.watchdog.idle()

    def share(self, message: dict | None = None, blobs: list[bytes] = ()) -> tuple[dict, list[bytes]]:
        """Process 0's ``message`` (JSON) and ``blobs`` on every process (the others pass nothing)."""
        if self.leads:
            payload = [json.dumps(message).encode(), *blobs]
            if len(payload) > MAX_PARTS:
                raise OptionError(f"at most {MAX_PARTS - 1} media items can be shared with the other processes in one request")
            header = [len(payload)] + [len(p) for p in payload]
        else:
            header = []
        # int32 throughout: what every backend and device sums (a request stays far below 2 GB).
        sizes = mx.array(header + [0] * (MAX_PARTS + 1 - len(header)), dtype=mx.int32)
        # A follower waits for the next request as long as heartbeats come (see ChatEngine.follow).
        limit = None if self.watchdog is None else self.watchdog.timeout
        count, *sizes = self._watched("waiting for process 0", lambda: self._sum(sizes), limit).tolist()
        sizes = sizes[:count]
        total = sum(sizes)
        if self.leads:
            data = mx.array(np.frombuffer(b"".join(payload), dtype=np.uint8))
        else:
            data = mx.zeros((total,), dtype=mx.uint8)
        data = self._watched("receiving a request from process 0", lambda: self._sum(data))
        raw = np.array(data).tobytes()
        parts, at = [], 0
        for n in sizes:
            parts.append(raw[at : at + n])
            at += n
        return json.loads(parts[0]), parts[1:]

    def leaders(self, value: int) -> int:
        """Process 0's ``value`` (an int32) on every process."""
        mine = mx.array([value if self.leads else 0], dtype=mx.int32)
        return int(self._watched("agreeing with the other processes", lambda: self._sum(mine)).item())

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every process's ``values`` (float32), by rank."""
        mine = mx.array(values, dtype=mx.float32)
        out = self._watched("gathering statistics", lambda: self._collective(mx.distributed.all_gather, mine))
        return out.reshape(self.size, len(values)).tolist()

    def most(self, value: int) -> int:
        """The largest of every process's ``value``."""
        mine = mx.array([value], dtype=mx.int32)
        return int(self._watched("agreeing with the other processes", lambda: self._collective(mx.distributed.all_max, mine)).item())


@contextlib.contextmanager
def peers_watched(group: mx.distributed.Group | None):
    """Turn the distributed backend's error for a peer gone (the ring backend's "connection to a
    peer was lost") into a :class:`PeerLostError` naming this process."""
    try:
        yield
    except RuntimeError as e:
        if group is None or isinstance(e, PeerLostError) or not re.search(r"\[(ring|jaccl|mpi)\]|peer", str(e)):
            raise
        raise PeerLostError(f"process {group.rank()} of {group.size()}: another process stopped or cannot be reached ({e})") from None


class AgreedStop:
    """A stop event every process reads alike: :meth:`is_set` is process 0's event at that moment
    (one tiny ``all_sum``), so all stop after the same token. Followers pass no event."""

    def __init__(self, lockstep: Lockstep, local: threading.Event | None):
        self.lockstep, self.local = lockstep, local

    def is_set(self) -> bool:
        return bool(self.lockstep.leaders(int(self.local is not None and self.local.is_set())))

    def set(self) -> None:
        if self.local is not None:
            self.local.set()


def pack_request(messages: list[dict], options: dict, cleanup: ExitStack) -> tuple[dict, list[bytes]]:
    """Process 0's request as JSON and the bytes of its media (the others cannot read process 0's
    files; ``http(s)`` URLs are fetched here once). Raises :class:`OptionError` for what cannot be
    shared (a custom sampler or logits processor: code, not data)."""
    from ..processing.sources import resolve_source

    for name in ("sampler", "logits_processors"):
        if options.get(name):
            raise OptionError(f"{name} cannot be shared with the other processes of a sharded model: use the sampling options")
    options = {k: v for k, v in options.items() if k not in ("sampler", "logits_processors", "stop_event")}
    blobs: list[bytes] = []

    def media(item: dict) -> dict:
        kind = item["type"]
        source = next((item[k] for k in (kind, "url", "path") if item.get(k) is not None), None)
        source = resolve_source(source, cleanup)
        if isinstance(source, (str, os.PathLike)) and Path(source).is_file():
            blobs.append(Path(source).read_bytes())
            suffix = Path(source).suffix
        elif hasattr(source, "save"):  # a PIL image: lossless
            buffer = io.BytesIO()
            source.save(buffer, format="PNG")
            blobs.append(buffer.getvalue())
            suffix = ".png"
        elif isinstance(source, (np.ndarray, mx.array)):  # raw audio samples or video frames
            buffer = io.BytesIO()
            np.save(buffer, np.array(source))
            blobs.append(buffer.getvalue())
            suffix = ".npy"
        else:
            return item  # a missing file: every process fails alike on it
        rest = {k: v for k, v in item.items() if k not in (kind, "url", "path")}
        return {**rest, "type": kind, "blob": len(blobs) - 1, "suffix": suffix}

    shared = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [media(i) if isinstance(i, dict) and i.get("type") in MEDIA_KINDS else i for i in content]
        shared.append({**message, "content": content})
    try:
        json.dumps([shared, options])
    except TypeError as e:
        raise OptionError(f"a request to a sharded model must be plain data to reach the other processes: {e}") from None
    return {"kind": "reply", "messages": shared, "options": options}, blobs


def unpack_request(message: dict, blobs: list[bytes], cleanup: ExitStack) -> tuple[list[dict], dict]:
    """A follower's messages and options from :func:`pack_request`'s; media become temporary files
    that ``cleanup`` removes."""
    folder = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="gemma4-shared-")))
    messages = []
    for m in message["messages"]:
        content = m.get("content")
        if isinstance(content, list):
            items = []
            for item in content:
                if isinstance(item, dict) and "blob" in item:
                    path = folder / f"{item['blob']}{item['suffix']}"
                    path.write_bytes(blobs[item["blob"]])
                    rest = {k: v for k, v in item.items() if k not in ("blob", "suffix")}
                    item = {**rest, item["type"]: np.load(path)} if item["suffix"] == ".npy" else {**rest, "path": str(path)}
                items.append(item)
            content = items
        messages.append({**m, "content": content})
    return messages, dict(message["options"])


def fresh_seed() -> int:
    """A seed process 0 draws for a sampled reply that names none: every process must sample alike
    (31 bits: it travels as an int32)."""
    return secrets.randbits(31)
