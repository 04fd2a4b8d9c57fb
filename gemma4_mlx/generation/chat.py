"""Multi-turn chat with prefix reuse: the engine behind ``python -m app``, importable on its own.

    chat = gemma4_mlx.Chat.load("google/gemma-4-E2B-it", system="Be brief.")
    print(chat.ask("What is MLX?"))
    for chunk in chat.send("And what is a KV cache?", images=["diagram.png"]):
        print(chunk.text, end="", flush=True)

:class:`ChatEngine` turns a whole conversation (a list of messages) into a streamed reply. Each turn
it renders the conversation with the chat template and reuses the KV cache of the prefix it has
already seen (:mod:`gemma4_mlx.prompt_cache`), so a new turn only prefills the new tokens; the
media encoders run only on media in that new part. :class:`Chat` keeps the messages for you.
"""

from __future__ import annotations

import atexit
import copy
import queue
import sys
import threading
import weakref
from collections import OrderedDict
from contextlib import ExitStack
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterator

import mlx.core as mx
import numpy as np
from mlx_lm.utils import maybe_set_recommended_wired_limit

from ..distributed.lockstep import AgreedStop, Lockstep, fresh_seed, pack_request, peers_watched, unpack_request
from ..distributed.traffic import Traffic
from ..errors import OptionError, PeerLostError
from ..memory import check_fits
from ..modalities import MODALITIES
from ..ops.compiled import release_thread
from .decode import GENERATION_STREAM, generate_tokens
from .speculative import DEFAULT_DRAFT_TOKENS, SpeculativeStats, fit_to_processes, load_checked_drafter, speculative_tokens
from .options import GenerationOptions
from .pipeline import Timing, prepare_request
from .prompt_cache import PromptCache, PromptCachePool
from .reply import Reply, ReplySplitter



@dataclass
class ReplyStats:
    prompt_tokens: int = 0  # the whole rendered conversation
    reused_tokens: int = 0  # of which came from the cache
    time_to_first_token: float = 0.0  # seconds, from the call to the first new token
    prompt_tps: float = 0.0  # prefilled (not reused) tokens per second
    generation_tokens: int = 0
    generation_tps: float = 0.0
    peak_memory: float = 0.0  # GB (MLX's peak allocation during the reply)
    draft: SpeculativeStats | None = None  # with a draft model: drafted and accepted tokens
    processes: list[ProcessStats] | None = None  # a sharded model: every process's, at the reply's end

    def summary(self) -> str:
        draft = shared = ""
        if self.draft is not None:
            d = self.draft
            draft = f" · drafts {d.acceptance_rate:.0%} accepted, {d.tokens_per_step:.2f} tokens per step"
        if self.processes:
            peaks = " / ".join(f"{p.peak_memory:.2f}" for p in self.processes)
            link = " / ".join(f"{p.traffic.seconds:.2f}" for p in self.processes)
            shared = f" · {len(self.processes)} processes: peak {peaks} GB, communication ~{link} s"
        return (
            f"{self.time_to_first_token:.2f} s to first token · prompt {self.prompt_tokens} tokens "
            f"({self.reused_tokens} reused), {self.prompt_tps:.1f} tok/s · {self.generation_tokens} tokens, "
            f"{self.generation_tps:.1f} tok/s{draft} · peak {self.peak_memory:.2f} GB{shared}"
        )


@dataclass
class ProcessStats:
    """One process of a sharded model, over one reply: its peak memory and its traffic with the others."""

    rank: int
    peak_memory: float  # GB
    traffic: Traffic


@dataclass
class ReplyOptions(GenerationOptions):
    """Options of :meth:`ChatEngine.stream` (and of :class:`Chat`): the generation options, and
    the chat's own."""

    max_tokens: int = 1024
    tools: list[dict] | None = None  # function declarations, rendered by the chat template
    reuse: bool = True  # False: prefill the whole conversation from a fresh cache
    speculative: bool = True  # with the engine's draft model; False: the target alone
    stop_event: threading.Event | None = None


@dataclass
class ChatChunk:
    """One streamed step of a reply."""

    text: str  # new text (may be empty)
    part: str  # "answer", "thinking" or "tool_call" (see gemma4_mlx.reply)
    reply: Reply  # the reply so far
    stats: ReplyStats = field(default_factory=ReplyStats)
    finish_reason: str | None = None  # "stop", "length", "tool_call" or "stopped" (cancelled)


class ChatEngine:
    """Streams replies to conversations, reusing the KV cache of their common prefix."""

    def __init__(
        self, model, processor, max_snapshots: int = 2, draft_model=None, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        max_caches: int = 1, cache_memory: int | None = None,
    ):  # fmt: skip
        """``draft_model`` (a Gemma 4 assistant: folder, Hub id or loaded drafter) speeds replies up
        by speculative decoding, ``num_draft_tokens`` per target step (``speculative=False`` in a
        reply's options turns it off for that reply). ``max_caches``: the KV caches of that many
        recent conversations are kept, each request continuing the one that shares most of its
        prompt (a server with several clients); ``cache_memory`` bounds their bytes (the least
        recently used go first)."""
        self.model = model
        self.processor = processor
        model.materialize()  # it is used from the engine's own thread
        # On Apple silicon, keep the weights wired (resident) for the engine's life, as mlx-lm's server does.
        maybe_set_recommended_wired_limit()
        self.drafter = load_checked_drafter(draft_model, model, num_draft_tokens, fit=False)
        self.num_draft_tokens = num_draft_tokens
        # A model shared by several processes (gemma4_mlx.distributed): process 0 leads, the others
        # follow (see lockstep.py); their caches drop what the fullest process must drop.
        self.lockstep = _lockstep(model)
        if self.lockstep is not None and self.lockstep.most(int(self.drafter is None)) and self.drafter is not None:
            print("Not drafting: another process of the sharded model has no drafter", file=sys.stderr, flush=True)
            self.drafter = None  # all draft or none: the processes run the same forward passes
        if self.drafter is not None:
            fit_to_processes(self.drafter, model)  # after agreeing: it changes what the forward passes exchange
            self.drafter.materialize()  # used from the engine's thread too
        turn_start = processor.tokenizer.convert_tokens_to_ids("<|turn>")
        self.caches = PromptCachePool(model, max_caches, max_snapshots, 1 if self.drafter is not None else 0, cache_memory, turn_start)
        if self.lockstep is not None:
            self.caches.agree = self.lockstep.most
        # Recent replies' text -> the token ids generated for it. When a conversation comes back with
        # one of them, it is rendered with these ids rather than its re-tokenized text, so the prompt
        # continues exactly what the cache holds (re-tokenizing generated text often gives other ids).
        self.replies: OrderedDict[str, list[int]] = OrderedDict()
        self._turn_start_id = processor.tokenizer.convert_tokens_to_ids("<|turn>")
        # MLX streams and in-flight arrays belong to a thread, and servers such as Gradio call each
        # step of a generator from whichever worker thread is free: all model work therefore runs
        # on one thread of ours, one reply at a time (the cache is shared), fed through a queue.
        self._jobs: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._running: set[threading.Event] = set()  # stop events of the replies being generated
        # The thread holds only the queue, so an engine nobody uses is freed, and its thread ends.
        weakref.finalize(self, _finish, self._jobs, self.lockstep)
        _ENGINES.add(self)
        if self.lockstep is not None and self.lockstep.leads:
            self._start_worker()  # its heartbeats keep the followers waiting for the first request

    def stream(self, messages: list[dict[str, Any]], **options) -> Iterator[ChatChunk]:
        """Stream the model's reply to ``messages`` (HF-style chat messages; content lists may hold
        ``{"type": "image" | "audio" | "video", "path": ...}`` items). ``options`` are the fields of
        :class:`ReplyOptions`. Setting ``stop_event`` (or closing the iterator) stops generation
        after the current token."""
        opts = ReplyOptions(**options)
        opts.stop_event = stop = opts.stop_event or threading.Event()
        if self.lockstep is not None and not self.lockstep.leads:
            raise OptionError(f"process {self.lockstep.rank} of a sharded model follows process 0: call follow(), not stream()")
        if self.lockstep is not None and self.lockstep.closed:
            raise OptionError("this engine was closed, and with it the other processes of the sharded model")
        out: queue.Queue = queue.Queue()

        def job():
            try:
                for chunk in self._lead(messages, opts) if self.lockstep is not None else self._stream(messages, opts):
                    out.put(chunk)
            except BaseException as e:  # handed to the caller's thread
                out.put(_Failure(e))
            finally:
                self._running.discard(stop)
                out.put(_DONE)

        self._running.add(stop)
        self._submit(job)
        finished = False
        try:
            pending: list = []
            while True:
                pending.append(out.get())
                # Whatever else is ready joins in: a slow consumer (a page updating per chunk)
                # gets fewer, bigger chunks instead of falling behind the model.
                while pending[-1] is not _DONE and not isinstance(pending[-1], _Failure):
                    try:
                        pending.append(out.get_nowait())
                    except queue.Empty:
                        break
                end = pending[-1] if pending[-1] is _DONE or isinstance(pending[-1], _Failure) else None
                chunks = pending[:-1] if end is not None else pending
                pending = []
                yield from _merge(chunks)
                if end is not None:
                    finished = True
                    if isinstance(end, _Failure):
                        raise end.error
                    return
        finally:
            if not finished:
                opts.stop_event.set()  # the caller went away: stop generating

    @property
    def prompt_cache(self) -> PromptCache:
        """The KV cache of the latest reply (see ``max_caches``)."""
        return self.caches.latest

    def _start_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            heartbeat = None
            if self.lockstep is not None:  # while idle, tell the followers process 0 is alive
                lockstep = self.lockstep
                heartbeat = (lambda: lockstep.share({"kind": "heartbeat"}), lockstep.heartbeat_interval)
            self._worker = threading.Thread(target=_work, args=(self._jobs, heartbeat), name="gemma4-chat-engine", daemon=True)
            self._worker.start()
            _WORKERS.add(self._worker)

    def _submit(self, job) -> None:
        self._start_worker()
        self._jobs.put(job)

    def close(self, timeout: float = 60.0) -> None:
        """Stop the replies in progress (after their current token or prefill chunk) and end the
        engine's thread; a later :meth:`stream` starts a new one. Done for every engine at exit:
        a thread still running MLX work when the interpreter ends would abort the process."""
        for stop in list(self._running):
            stop.set()
        worker = self._worker
        if worker is not None and worker.is_alive() and worker is not threading.current_thread():
            if self.lockstep is not None and not self.lockstep.closed:
                self._jobs.put(_quit(self.lockstep))  # the followers return from follow()
            self._jobs.put(None)
            worker.join(timeout)

    def follow(self) -> None:
        """On a process other than 0 of a sharded model (:func:`gemma4_mlx.distributed.load_sharded`):
        run process 0's requests, in its order, until its engine closes (its script or server ends).
        Stops the process with a message if process 0 is gone for longer than the time limit."""
        lockstep = self.lockstep
        if lockstep is None or lockstep.leads:
            raise OptionError("follow() is for the processes other than 0 of a model loaded with load_sharded")
        # On a thread of its own, as process 0 runs requests on its engine's thread: the same code path.
        failure: list[BaseException] = []

        def run():
            try:
                self._follow()
            except BaseException as e:
                failure.append(e)
            finally:
                release_thread(GENERATION_STREAM)  # before join() returns: see ops.compiled

        worker = threading.Thread(target=run, name="gemma4-chat-follower", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(1.0)  # in short waits: Ctrl-C still reaches the main thread
        if failure:
            raise failure[0]

    def _follow(self) -> None:
        lockstep = self.lockstep
        while True:
            message, blobs = lockstep.share()
            if message["kind"] == "quit":
                lockstep.closed = True
                return
            if message["kind"] != "reply":
                continue  # a heartbeat
            with ExitStack() as cleanup:
                messages, options = unpack_request(message, blobs, cleanup)
                o = ReplyOptions(**options, stop_event=AgreedStop(lockstep, None))
                try:
                    with peers_watched(lockstep.group):
                        for _ in self._stream(messages, o):
                            pass
                except PeerLostError:
                    raise
                except Exception as e:  # process 0 met the same error and reports it to its caller
                    print(f"[rank {lockstep.rank}] request failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if self.model.watchdog is not None:
                self.model.watchdog.idle()

    def _lead(self, messages: list[dict[str, Any]], o: "ReplyOptions") -> Iterator[ChatChunk]:
        """Process 0 of a sharded model: hand the request to the followers, then run it with them."""
        lockstep = self.lockstep
        if o.seed is None and o.temperature > 0:  # every process must draw the same samples
            o = replace(o, seed=fresh_seed())
        with ExitStack() as cleanup:
            options = {f.name: getattr(o, f.name) for f in fields(o)}
            message, blobs = pack_request(messages, options, cleanup)
            lockstep.share(message, blobs)
        try:
            with peers_watched(lockstep.group):
                yield from self._stream(messages, replace(o, stop_event=AgreedStop(lockstep, o.stop_event)))
        finally:
            if self.model.watchdog is not None:
                self.model.watchdog.idle()

    def _process_stats(self, peak_memory: float, traffic: Traffic) -> list[ProcessStats]:
        """Every process's peak memory and traffic over the reply (one gather)."""
        rows = self.lockstep.gather([peak_memory, traffic.transfers, traffic.bytes / 1e6])
        return [
            ProcessStats(r, peak, replace(traffic, transfers=int(n), bytes=int(mb * 1e6)))  # the link as this process measured it
            for r, (peak, n, mb) in enumerate(rows)
        ]

    def _agreed(self, fn):
        """``fn()``, whose failure on any process of a sharded model fails it on all (before the
        caches change: a request one process cannot take, none takes)."""
        try:
            result, problem = fn(), None
        except Exception as e:
            result, problem = None, e
        if self.lockstep is not None and self.lockstep.most(int(problem is not None)) and problem is None:
            raise OptionError("another process of the sharded model could not take this request (its output says why)")
        if problem is not None:
            raise problem
        return result

    def _stream(self, messages: list[dict[str, Any]], o: "ReplyOptions") -> Iterator[ChatChunk]:
        timing = Timing(prefilled=0)
        template = {"tools": o.tools} if o.tools else {}
        request = self._agreed(lambda: prepare_request(self.model, self.processor, messages, o, replies=self.replies, **template))
        ids = request.ids
        # Snapshot points: where the last user turn and the generation prompt begin. Regenerating
        # or editing the last message rewinds to one of them, and so does the next turn when the
        # template renders the reply differently from how it was generated.
        turn_starts = [i for i, t in enumerate(ids) if t == self._turn_start_id]
        pc = self.caches.take(ids)
        quantization = (o.kv_bits, o.kv_group_size)
        # Before the cache changes (each process checks its own memory).
        self._agreed(lambda: check_fits(self.model, len(ids) + request.max_tokens, pc.cache, o.prefill_step_size, *quantization))
        if not o.reuse or pc.kv_quantization != quantization:
            pc.reset(*quantization)  # a cache quantized otherwise cannot be continued
        try:
            start = pc.reuse(ids)
            embeds = self._embed_new_part(ids, start, request.media)
            with mx.stream(GENERATION_STREAM):
                done = pc.extend(
                    self.model, ids[: len(ids) - 1], embeds, request.vision_blocks, set(turn_starts[-2:]),
                    o.prefill_step_size, stop=o.stop_event.is_set,
                )  # fmt: skip
        except BaseException:
            pc.reset()  # a half-filled cache must not be reused
            raise
        timing.prefilled = len(ids) - start
        stats = ReplyStats(prompt_tokens=len(ids), reused_tokens=start)
        if not done:  # stopped between prefill chunks: the cache keeps whole chunks, still reusable
            stats.peak_memory = timing.peak_memory
            yield ChatChunk("", "answer", Reply(), stats, "stopped")
            return
        last_embeds = None if embeds is None else embeds[len(ids) - 1 - start :]
        drafting = o.speculative and self.drafter is not None
        if drafting and o.sampler is not None:
            raise OptionError("a custom sampler cannot be used with a draft model: pass speculative=False")
        yield from self._decode(request, last_embeds, o, timing, stats, drafting)

    def _decode(self, request, last_embeds, o, timing, stats, drafting) -> Iterator[ChatChunk]:
        ids, pc, stop_event = request.ids, self.caches.latest, o.stop_event
        traffic = self.model.traffic.copy() if self.model.traffic is not None else None
        tool_response = self._tool_response_ids()
        eos = set(self.processor.eos_token_ids) | tool_response
        splitter = ReplySplitter(self.processor)
        generated: list[int] = []
        if drafting:
            stats.draft = SpeculativeStats()
            tokens = speculative_tokens(
                self.model, self.drafter, mx.array(ids[-1:]), pc.cache, request.max_tokens, request.sampler,
                request.logits_processors, o.make_distribution(), self.num_draft_tokens, inputs_embeds=last_embeds,
                history=mx.array(ids), stats=stats.draft,
            )  # fmt: skip
        else:
            tokens = generate_tokens(
                self.model, mx.array(ids[-1:]), pc.cache, request.max_tokens, request.sampler, request.logits_processors,
                inputs_embeds=last_embeds, history=mx.array(ids),
            )  # fmt: skip
        try:
            for token, _ in tokens:
                timing.token()
                generated.append(token)
                stats.time_to_first_token, stats.prompt_tps = timing.time_to_first_token, timing.prompt_tps
                stats.generation_tokens, stats.generation_tps = timing.tokens, timing.generation_tps
                stats.peak_memory = timing.peak_memory
                finish = None
                pieces = []
                if token in eos:
                    finish = "tool_call" if token in tool_response or splitter.reply.tool_calls else "stop"
                else:
                    pieces.append(splitter.add(token))
                    if timing.tokens == request.max_tokens:
                        finish = "length"
                    elif stop_event is not None and stop_event.is_set():
                        finish = "stopped"
                if finish:
                    pieces.append(splitter.finish())
                    if self.lockstep is not None:  # every process reaches this token's end alike
                        stats.processes = self._process_stats(timing.peak_memory, self.model.traffic.since(traffic))
                pieces = [p for p in pieces if p[1]] or [(splitter.part, "")]
                for i, (part, text) in enumerate(pieces):
                    # Copies: the caller reads them on another thread while this one goes on.
                    snapshot = copy.copy(stats)
                    snapshot.draft = copy.copy(stats.draft)
                    yield ChatChunk(text, part, _copy_reply(splitter.reply), snapshot, finish if i == len(pieces) - 1 else None)
                if finish:
                    break
            self._remember(splitter)
        finally:
            tokens.close()
            # The decode loop runs one step ahead: the cache holds the prompt and every token fed so far.
            pc.advance(ids + generated)
            self.caches.fit()

    def _remember(self, splitter: ReplySplitter, keep: int = 2048) -> None:
        """Keep the ids of a finished reply's answer, keyed by its text (the ``keep`` latest texts).

        The first ids seen for a text stay: two replies with the same text (but other ids) then render
        alike, so a conversation always renders to the same prompt, and greedy replies repeat."""
        text = splitter.reply.content.strip()
        if text and splitter.answer_ids and splitter.answer_ids_usable:
            self.replies.setdefault(text, list(splitter.answer_ids))
            self.replies.move_to_end(text)
            while len(self.replies) > keep:
                self.replies.popitem(last=False)

    def _embed_new_part(self, ids: list[int], start: int, media_inputs: dict) -> mx.array | None:
        """Embeddings of ``ids[start:]`` with the soft tokens of the media in that part (None when
        that part has no media); media before ``start`` are already in the cache and not encoded."""
        cfg = self.model.config
        tail = np.array(ids[start:])
        media = {}
        for modality in MODALITIES.values():
            token_id, arrays = getattr(cfg, modality.token_field, None), modality.arrays
            if token_id is None or media_inputs.get(arrays[0]) is None or not (tail == token_id).any():
                continue
            # Items whose placeholder runs begin before `start` (never cut: the cache only rewinds
            # to message boundaries) are skipped; each item is one run of its placeholder token.
            done = _count_runs(np.array(ids[:start]) == token_id)
            for name in arrays:
                media[name] = media_inputs[name][done:]
        if not media:
            return None
        return self.model.embed_multimodal(mx.array(ids[start:]), **media)[0]

    def _tool_response_ids(self) -> set[int]:
        tok = self.processor.tokenizer
        i = tok.convert_tokens_to_ids("<|tool_response>")
        return {i} if isinstance(i, int) and i != tok.unk_token_id else set()


def _work(jobs: queue.Queue, heartbeat=None) -> None:
    """An engine's thread: run its jobs in order until it is closed (None). ``heartbeat``, a
    ``(function, seconds)`` pair, is called whenever that long passes without a job."""
    try:
        while True:
            try:
                job = jobs.get(timeout=heartbeat[1]) if heartbeat else jobs.get()
            except queue.Empty:
                heartbeat[0]()
                continue
            if job is None:
                return
            job()
            del job  # the finished job refers to its engine: let the engine go while this thread waits
    finally:
        release_thread(GENERATION_STREAM)  # before join() returns: see ops.compiled


def _quit(lockstep) -> Any:
    """A job telling the followers of a sharded model that process 0's engine is closing."""

    def run():
        if not lockstep.closed:
            lockstep.closed = True
            lockstep.share({"kind": "quit"})

    return run


def _finish(jobs: queue.Queue, lockstep) -> None:
    """An engine was freed: its followers return, its thread ends."""
    if lockstep is not None and lockstep.leads:
        jobs.put(_quit(lockstep))
    jobs.put(None)


def _lockstep(model):
    """The :class:`Lockstep` of a model loaded by ``load_sharded`` (None for one process)."""
    group = getattr(model.language_model, "group", None)
    if group is None:
        return None
    return Lockstep(group, model.watchdog, model.traffic)


_ENGINES: "weakref.WeakSet[ChatEngine]" = weakref.WeakSet()
_WORKERS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()  # engines' threads, alive or not


@atexit.register
def _close_engines(timeout: float = 60.0) -> None:
    for engine in list(_ENGINES):
        engine.close(timeout)
    # The threads of engines already freed are ending too (told by _finish): joined as well, since
    # one ending as the interpreter finalizes aborts the process (ops/compiled.py).
    for worker in list(_WORKERS):
        if worker is not threading.current_thread():
            worker.join(timeout)


def _merge(chunks: list[ChatChunk]) -> list[ChatChunk]:
    """Consecutive chunks of the same part as one (the latest reply, stats and finish reason)."""
    merged: list[ChatChunk] = []
    for c in chunks:
        if merged and merged[-1].part == c.part and merged[-1].finish_reason is None:
            c = ChatChunk(merged[-1].text + c.text, c.part, c.reply, c.stats, c.finish_reason)
            merged[-1] = c
        else:
            merged.append(c)
    return merged


def _copy_reply(reply: Reply) -> Reply:
    return Reply(reply.thinking, reply.content, list(reply.tool_calls))


@dataclass
class _Failure:
    error: BaseException


_DONE = object()


def _count_runs(mask: np.ndarray) -> int:
    if mask.size == 0:
        return 0
    return int(mask[0]) + int(np.count_nonzero(mask[1:] & ~mask[:-1]))


class Chat:
    """A conversation: keeps the messages and streams replies through a :class:`ChatEngine`.

    ``send`` adds a user turn and streams the reply; ``ask`` returns it whole. ``regenerate``,
    ``undo`` and ``reset`` edit the conversation; generation options given to the constructor
    (``temperature``, ``max_tokens``, ``enable_thinking``, ``tools``, ...) apply to every turn and
    can be overridden per call.
    """

    def __init__(
        self, model, processor, system: str | None = None, engine: ChatEngine | None = None, draft_model=None,
        num_draft_tokens: int = DEFAULT_DRAFT_TOKENS, **options,
    ):  # fmt: skip
        self.engine = engine or ChatEngine(model, processor, draft_model=draft_model, num_draft_tokens=num_draft_tokens)
        self.system = system
        self.messages: list[dict[str, Any]] = []
        ReplyOptions(**options)  # bad options fail here, not at the first reply
        self.options = options
        self.last_stats: ReplyStats | None = None
        self.last_reply: Reply | None = None

    @classmethod
    def load(cls, path_or_repo: str, system: str | None = None, draft_model=None, **options) -> "Chat":
        """Load a model (see :func:`gemma4_mlx.load`) and start a conversation with it
        (``draft_model``: a Gemma 4 assistant for speculative decoding, see :class:`ChatEngine`)."""
        from ..loading import load

        model, processor = load(path_or_repo)
        return cls(model, processor, system=system, draft_model=draft_model, **options)

    def follow(self) -> None:
        """On processes other than 0 of a sharded model: run process 0's chat (see :meth:`ChatEngine.follow`)."""
        self.engine.follow()

    def _conversation(self) -> list[dict[str, Any]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def send(self, text: str = "", images=(), audio=(), videos=(), **options) -> Iterator[ChatChunk]:
        """Add a user message (text and media files) and stream the reply."""
        content: list[dict[str, Any]] = [{"type": "image", "path": str(p)} for p in images]
        content += [{"type": "audio", "path": str(p)} for p in audio] + [{"type": "video", "path": str(p)} for p in videos]
        message = {"role": "user", "content": content + [{"type": "text", "text": text}] if content else text}
        self.messages.append(message)
        try:
            yield from self._reply(**options)
        except BaseException:
            if self.messages and self.messages[-1] is message:
                self.messages.pop()  # a turn that failed before any reply leaves no trace
            raise

    def ask(self, text: str = "", **kwargs) -> str:
        """Like :meth:`send`, returning the whole answer (reasoning excluded)."""
        for _ in self.send(text, **kwargs):
            pass
        return self.last_reply.content if self.last_reply else ""

    def regenerate(self, **options) -> Iterator[ChatChunk]:
        """Drop the last reply and stream a new one."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages:
            raise ValueError("nothing to regenerate: the conversation is empty")
        yield from self._reply(**options)

    def undo(self) -> None:
        """Remove the last exchange (the last user message and the reply to it)."""
        while self.messages and self.messages[-1]["role"] != "user":
            self.messages.pop()
        if self.messages:
            self.messages.pop()

    def reset(self) -> None:
        self.messages.clear()

    def _reply(self, **options) -> Iterator[ChatChunk]:
        chunk = None
        for chunk in self.engine.stream(self._conversation(), **{**self.options, **options}):
            yield chunk
        if chunk is not None:
            self.last_reply, self.last_stats = chunk.reply, chunk.stats
            self.messages.append(chunk.reply.as_message())
