"""The chat engine: prefix reuse across turns (greedy replies identical with and without reuse,
sliding-window caches wrapped), media in later turns, reply splitting and the Chat API."""

import sys
import threading

import mlx.core as mx
import numpy as np
import pytest
import soundfile as sf
from checkpoints import AUDIO, LARGE_VIT, SMALL_VIT, build_hf_model, save_checkpoint
from PIL import Image

import gemma4_mlx
from gemma4_mlx.generation.chat import Chat, ChatEngine
from gemma4_mlx.errors import ContextLengthError
from mlx_lm.utils import common_prefix_len as common_prefix_length

from gemma4_mlx.generation.prompt_cache import PromptCache
from gemma4_mlx.generation.reply import ReplySplitter, parse_tool_call

TURNS = ["hello model, tell me about the water", "and what about the people of the world", "write one more word", "why"]


@pytest.fixture(scope="module", params=["e2b", "moe26b", "dense31b"])
def family_model(request, tmp_path_factory):
    # Small windows (8/8/16 tokens) so that every conversation wraps the sliding-window caches.
    towers = {"e2b": dict(vision_config=SMALL_VIT, audio_config=AUDIO)}.get(request.param, dict(vision_config=LARGE_VIT))
    hf = build_hf_model(request.param, **towers)
    path = save_checkpoint(hf, tmp_path_factory.mktemp(request.param))
    return gemma4_mlx.load(path)


def _converse(engine: ChatEngine, turns, reuse: bool, **options):
    template = {k: v for k, v in options.items() if k == "enable_thinking"}
    messages, replies, stats = [], [], []
    for turn in turns:
        # What this turn must at least reuse: the conversation before the previous reply (as the engine
        # renders it: earlier replies as the ids that generated them).
        history = messages[:-1] and engine.processor.apply_chat_template(
            messages[:-1], add_generation_prompt=False, tokenize=True, replies=engine.replies, **template
        )
        engine.history_tokens = len(history)
        messages.append({"role": "user", "content": turn})
        chunks = list(engine.stream(messages, max_tokens=6, temperature=0.0, reuse=reuse, **options))
        reply = chunks[-1].reply
        replies.append((reply.content, chunks[-1].finish_reason))
        stats.append(chunks[-1].stats)
        stats[-1].history_tokens = engine.history_tokens
        messages.append(reply.as_message())
    return replies, stats


@pytest.mark.parametrize("thinking", [False, True])
def test_reuse_gives_the_same_replies(family_model, thinking):
    model, processor = family_model
    with_reuse, stats = _converse(ChatEngine(model, processor), TURNS, reuse=True, enable_thinking=thinking)
    without, fresh_stats = _converse(ChatEngine(model, processor), TURNS, reuse=False, enable_thinking=thinking)
    assert with_reuse == without
    assert all(s.reused_tokens == 0 for s in fresh_stats)
    # Every later turn reuses the conversation up to the previous reply (which the template may
    # render differently from how it was generated: the 31B-style template drops the empty
    # reasoning channel), so only the last reply and the new message are prefilled.
    for s in stats[1:]:
        assert s.reused_tokens >= s.history_tokens - 1 > 0
    assert stats[-1].prompt_tokens > 3 * model.text_config.sliding_window  # the ring buffers wrapped


def test_regenerate_and_edit_rewind_through_snapshots(family_model):
    model, processor = family_model
    engine = ChatEngine(model, processor)
    messages = [{"role": "user", "content": TURNS[0]}]
    first = list(engine.stream(messages, max_tokens=6))[-1]
    messages += [first.reply.as_message(), {"role": "user", "content": TURNS[1]}]
    second = list(engine.stream(messages, max_tokens=6))[-1]
    again = list(engine.stream(messages, max_tokens=6))[-1]  # regenerate: same prompt
    assert again.reply.content == second.reply.content
    generation_prompt = processor.encode(processor.apply_chat_template([{"role": "user", "content": ""}]).split("<turn|>")[-1], add_special_tokens=False)
    assert again.stats.reused_tokens >= again.stats.prompt_tokens - len(generation_prompt) - 1
    messages[-1] = {"role": "user", "content": TURNS[2]}  # edit the last message
    edited = list(engine.stream(messages, max_tokens=6))[-1]
    fresh_engine = ChatEngine(model, processor)
    fresh_engine.replies.update(engine.replies)  # the same prompt: earlier replies as their generated ids
    fresh = list(fresh_engine.stream(messages, max_tokens=6))[-1]
    assert edited.reply.content == fresh.reply.content
    assert edited.stats.reused_tokens > 0


def test_engine_generates_what_stream_generate_does(family_model):
    """Greedy: the same tokens, sampled through the same recording sampler by both paths (each
    decoding with compiled layer pieces, traced on its own thread)."""
    model, processor = family_model
    messages = [{"role": "user", "content": TURNS[0]}]

    def recording(seen):
        def sampler(logprobs):
            token = mx.argmax(logprobs, axis=-1)
            seen.append(token)
            return token

        return sampler

    plain, engine = [], []
    expected = [c.token for c in gemma4_mlx.stream_generate(model, processor, messages, max_tokens=6, sampler=recording(plain))]
    chat_engine = ChatEngine(model, processor)
    list(chat_engine.stream(messages, max_tokens=6, sampler=recording(engine)))
    first_piece = model.language_model._compiled_pieces[0]
    assert chat_engine._worker.ident in first_piece._impls  # the engine's thread decodes with the compiled pieces too
    # Both loops sample one token ahead of what they hand out; what they hand out must agree.
    assert len(expected) >= 1 and [int(t.item()) for t in engine][: len(expected)] == expected
    assert [int(t.item()) for t in plain][: len(expected)] == expected


def _image(path, seed):
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(path)
    return str(path)


def test_media_in_later_turns(family_model, tmp_path):
    model, processor = family_model
    if not model.has_vision:
        pytest.skip("this family's test checkpoint has no vision tower (text-only by design)")
    turns = [
        [{"type": "text", "text": "hello"}],
        [{"type": "image", "path": _image(tmp_path / "a.png", 1)}, {"type": "text", "text": "what is this"}],
        [{"type": "image", "path": _image(tmp_path / "b.png", 2)}, {"type": "text", "text": "and this"}],
    ]
    if model.has_audio:
        wav = tmp_path / "tone.wav"
        sf.write(wav, (0.3 * np.sin(np.arange(8000) / 16000 * 2 * np.pi * 440)).astype(np.float32), 16000)
        turns.append([{"type": "audio", "path": str(wav)}, {"type": "text", "text": "and listen"}])
    with_reuse, stats = _converse(ChatEngine(model, processor), turns, reuse=True, max_soft_tokens=70)
    without, _ = _converse(ChatEngine(model, processor), turns, reuse=False, max_soft_tokens=70)
    assert with_reuse == without
    assert all(s.reused_tokens > 0 for s in stats[1:])


def test_context_overflow_leaves_the_cache_usable(family_model):
    model, processor = family_model
    engine = ChatEngine(model, processor)
    messages = [{"role": "user", "content": TURNS[0]}]
    first = list(engine.stream(messages, max_tokens=4))[-1]
    with pytest.raises(ContextLengthError):
        list(engine.stream([{"role": "user", "content": "word " * 5000}], max_tokens=4))
    again = list(engine.stream(messages, max_tokens=4))[-1]
    assert again.reply.content == first.reply.content


def test_stop_event_stops_generation(family_model):
    model, processor = family_model
    engine = ChatEngine(model, processor)
    stop = threading.Event()
    chunks = []
    for chunk in engine.stream([{"role": "user", "content": "hi"}], max_tokens=500, temperature=1.0, seed=0, stop_event=stop):
        chunks.append(chunk)
        if len(chunks) == 3:
            stop.set()
    assert chunks[-1].finish_reason == "stopped"
    assert chunks[-1].stats.generation_tokens <= 4
    # The engine goes on working after a stop, and closing a stream early is a stop too.
    stream = engine.stream([{"role": "user", "content": "hi"}], max_tokens=500, temperature=1.0, seed=0)
    next(stream)
    stream.close()
    assert list(engine.stream([{"role": "user", "content": "hi"}], max_tokens=3))[-1].finish_reason in ("length", "stop")


def test_chat_api(family_model):
    model, processor = family_model
    chat = Chat(model, processor, system="be brief", max_tokens=5)
    a = chat.ask("hello")
    b = chat.ask("and again")
    assert len(chat.messages) == 4 and chat.messages[-1]["content"] == b.strip()
    assert chat.last_stats.reused_tokens > 0
    regenerated = "".join(c.text for c in chat.regenerate())
    assert regenerated.strip() == b.strip()  # greedy
    chat.undo()
    assert len(chat.messages) == 2 and chat.messages[-1]["content"] == a.strip()
    with pytest.raises(gemma4_mlx.MediaError):
        chat.ask("look", images=["/nonexistent/picture.png"])
    assert len(chat.messages) == 2  # a failed turn leaves no trace
    chat.reset()
    assert chat.messages == []


# ---------------------------------------------------------------------------- reply splitting
def test_reply_splitter_separates_reasoning_answer_and_tool_calls(family_model):
    _, processor = family_model
    text = '<|channel>thought\nthe user wants weather<channel|>Let me check.<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3,units:{metric:true},tags:[<|"|>a<|"|>,2.5]}<tool_call|>'
    ids = processor.encode(text, add_special_tokens=False)
    splitter = ReplySplitter(processor)
    parts: dict[str, str] = {}
    for token in ids:
        part, piece = splitter.add(token)
        parts[part] = parts.get(part, "") + piece
    splitter.finish()
    reply = splitter.reply
    assert reply.thinking == "the user wants weather" == parts["thinking"]
    assert reply.content == "Let me check." == parts["answer"]
    assert [c.name for c in reply.tool_calls] == ["get_weather"]
    assert reply.tool_calls[0].arguments == {"city": "Paris, FR", "days": 3, "units": {"metric": True}, "tags": ["a", 2.5]}
    message = reply.as_message()
    assert message["tool_calls"][0]["function"]["arguments"]["city"] == "Paris, FR"
    # The template renders the call back in Gemma's syntax.
    rendered = processor.apply_chat_template([{"role": "user", "content": "hi"}, message], add_generation_prompt=False)
    assert "<|tool_call>call:get_weather{" in rendered and 'city:<|"|>Paris, FR<|"|>' in rendered


def test_parse_tool_call_edge_cases():
    assert parse_tool_call("call:noargs{}").arguments == {}
    assert parse_tool_call("call:f").name == "f"
    broken = parse_tool_call("call:f{a:<|\"|>unterminated")
    assert broken.name == "f" and broken.arguments == {} and "unterminated" in broken.raw
    assert parse_tool_call('call:f{"<|"|>k<|"|>":1}'.replace('"<|"|>k<|"|>"', '<|"|>k<|"|>')).arguments == {"k": 1}
    assert parse_tool_call("call:f{x:-2,y:1e3,z:null,w:word}").arguments == {"x": -2, "y": 1000.0, "z": None, "w": "word"}


@pytest.mark.parametrize(
    "text, arguments",
    [
        ("call:f{a:1, b:2}", {"a": 1, "b": 2}),  # a space after a comma
        ("call:f{ a:1}", {"a": 1}),  # a space before a key
        ("call:f{w:word}", {"w": "word"}),  # a bare word
        ("call:f{x:None}", {"x": None}),  # Python's None
        ("call:ns.get{x:1}", {"x": 1}),  # a dotted function name
    ],
)
def test_our_tool_call_parser_where_mlx_lms_fails(text, arguments):
    """mlx-lm's Gemma 4 tool-call parser would do, but it fails on these calls, which ours parses:
    why gemma4_mlx.generation.reply keeps its own."""
    from mlx_lm.tool_parsers.gemma4 import parse_tool_call as mlx_lm_parse

    try:
        theirs = mlx_lm_parse(text)
    except ValueError:  # json.JSONDecodeError is a ValueError
        theirs = None
    assert theirs is None
    call = parse_tool_call(text)
    assert call.name == text[5 : text.index("{")] and call.arguments == arguments


def test_scripted_reply_streams_parts_in_order(family_model):
    """A sampler that plays back a fixed reply drives the whole engine through reasoning, answer and a tool call."""
    model, processor = family_model
    script = processor.encode("<|channel>thought\nhmm<channel|>Sure.<|tool_call>call:f{a:1}<tool_call|>", add_special_tokens=False)
    end = processor.tokenizer.convert_tokens_to_ids("<turn|>")
    it = iter(script)
    sampler = lambda logprobs: mx.array([next(it, end)])  # noqa: E731 (the loop samples one token ahead)
    chunks = list(ChatEngine(model, processor).stream([{"role": "user", "content": "hi"}], sampler=sampler, max_tokens=100))
    order = [c.part for c in chunks if c.text]
    assert order.index("thinking") < order.index("answer")
    last = chunks[-1]
    assert last.finish_reason == "tool_call"
    assert last.reply.thinking == "hmm" and last.reply.content == "Sure."
    assert last.reply.tool_calls[0].name == "f" and last.reply.tool_calls[0].arguments == {"a": 1}


def test_prompt_cache_snapshot_is_a_copy(family_model):
    model, _ = family_model
    pc = PromptCache(model)
    ids = list(range(5, 40))
    model(mx.array([ids[:20]]), cache=pc.cache)
    pc.ids = ids[:20]
    pc.snapshot()
    model(mx.array([ids[20:]]), cache=pc.cache)
    pc.ids = ids
    assert pc.reuse(ids[:20] + [7, 8, 9]) == 20
    fresh = model.make_cache()
    a = model(mx.array([[7, 8, 9]]), cache=pc.cache)
    model(mx.array([ids[:20]]), cache=fresh)
    b = model(mx.array([[7, 8, 9]]), cache=fresh)
    assert mx.allclose(a, b, atol=1e-5).item()
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2


def test_stop_during_prefill_keeps_the_cache_consistent(family_model):
    """Stop set while a long prompt is prefilled: the reply ends at once, and what was prefilled is
    reused by the next call, which still gives the same greedy reply as a fresh engine."""
    model, processor = family_model
    engine = ChatEngine(model, processor)
    stop = threading.Event()
    stop.set()
    messages = [{"role": "user", "content": " ".join(TURNS * 6)}]
    chunks = list(engine.stream(messages, max_tokens=5, stop_event=stop, prefill_step_size=16))
    assert len(chunks) == 1 and chunks[0].finish_reason == "stopped" and chunks[0].stats.generation_tokens == 0
    held = engine.prompt_cache.offset
    assert held == len(engine.prompt_cache.ids) and 0 < held <= 16  # the first chunk, then the stop
    resumed = list(engine.stream(messages, max_tokens=5, prefill_step_size=16))[-1]
    fresh = list(ChatEngine(model, processor).stream(messages, max_tokens=5))[-1]
    assert resumed.stats.reused_tokens == held
    assert resumed.reply.content == fresh.reply.content


def test_replies_come_back_as_the_ids_that_generated_them(tmp_path):
    """A later turn prefills only its new message, even when the replies' text does not re-tokenize
    to the ids the model generated (an E2B-style template, which keeps no empty reasoning channel)."""
    from gemma4_mlx.testing import build_demo_checkpoint

    model, processor = gemma4_mlx.load(build_demo_checkpoint(tmp_path / "demo"))
    media = [model.config.image_token_id, model.config.audio_token_id, model.config.video_token_id]
    avoid = mx.zeros((model.text_config.vocab_size,)).at[mx.array(media)].add(-mx.inf)
    mx.eval(avoid)  # made here, used on the engine's thread
    sampler = lambda logprobs: mx.random.categorical(logprobs + avoid)  # noqa: E731 (no media tokens in replies)
    engine = ChatEngine(model, processor)
    messages, retokenized_differently = [], 0
    for i, turn in enumerate(TURNS):
        messages.append({"role": "user", "content": turn})
        held = list(engine.prompt_cache.ids)  # the previous prompt and the tokens generated after it
        reply = list(engine.stream(messages, max_tokens=12, sampler=sampler, seed=i))[-1]
        prompt = processor.prepare(messages[:-1] + [messages[-1]], replies=engine.replies)["input_ids"][0].tolist()
        if i:
            assert prompt[: len(held)] == held  # the new prompt continues exactly what the cache holds
            assert reply.stats.reused_tokens == len(held) and reply.stats.prompt_tokens == len(prompt)
        ids = engine.replies[reply.reply.content.strip()]
        retokenized_differently += processor.encode(reply.reply.content.strip(), add_special_tokens=False) != ids
        messages.append(reply.reply.as_message())
    assert retokenized_differently  # else this test would pass without keeping the generated ids


LEAVE_EARLY = """
import sys, gemma4_mlx
chat = gemma4_mlx.Chat.load(sys.argv[1])
how = sys.argv[2]
stream = chat.send("tell me a long story", max_tokens=100000)
if how == "break":
    for i, _ in enumerate(stream):
        if i == 3:
            break
elif how == "raise":
    try:
        for i, _ in enumerate(stream):
            if i == 3:
                raise RuntimeError("the caller failed")
    except RuntimeError as e:
        kept = e  # the traceback keeps the stream alive until exit
else:  # "keep": a stream left open, generating on the engine's thread
    next(stream)
    next(stream)
print("leaving")
"""


@pytest.mark.parametrize("how", ["break", "raise", "keep"])
def test_leaving_a_reply_early_then_exiting_is_clean(tmp_path, how):
    """The engine's thread is stopped and joined at exit: a thread still in MLX work when the
    interpreter ends aborts the process ("terminate called without an active exception", rc 134)."""
    import subprocess
    import sys

    from gemma4_mlx.testing import build_demo_checkpoint

    folder = build_demo_checkpoint(tmp_path / "demo")
    run = subprocess.run([sys.executable, "-c", LEAVE_EARLY, str(folder), how], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "leaving" and "terminate called" not in run.stderr


SAMPLE_THEN_EXIT_LATE = """
import ctypes, sys, time
import gemma4_mlx
chat = gemma4_mlx.Chat.load(sys.argv[1])
stream = chat.send("tell me a long story", max_tokens=100000, temperature=0.8)
next(stream)
next(stream)

def delay_thread_exit():
    # On the engine's thread: its thread-local destructors run in reverse order of registration,
    # so this half-second sleep comes just before MLX frees the thread's compile cache.
    libc = ctypes.CDLL(None)
    libc.__cxa_thread_atexit_impl(ctypes.cast(libc.usleep, ctypes.c_void_p), ctypes.c_void_p(500_000), None)

chat.engine._submit(delay_thread_exit)

class SlowToFinalize:  # the interpreter is finalizing (the GIL free, other threads told to exit)
    def __del__(self, sleep=time.sleep):
        sleep(2)

slow = SlowToFinalize()
print("leaving")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="delays a thread's exit with a hook only Linux's glibc has (__cxa_thread_atexit_impl); the fix it checks is the same on macOS")
def test_the_engine_thread_leaves_nothing_for_mlx_to_free_after_exit(tmp_path):
    """The race behind the flaky aborts above, made certain: mlx-lm's sampler is compiled at
    import and run on the engine's thread, so its trace sits in that thread's compile cache, which
    MLX frees (taking the GIL) only when the OS thread ends, after join() returned. If that is
    during finalization, the thread is killed inside a destructor and the process aborts. The
    engine's thread empties its cache as its last step (ops.compiled.release_thread)."""
    import subprocess

    from gemma4_mlx.testing import build_demo_checkpoint

    folder = build_demo_checkpoint(tmp_path / "demo")
    run = subprocess.run([sys.executable, "-c", SAMPLE_THEN_EXIT_LATE, str(folder)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "leaving" and "terminate called" not in run.stderr


FREE_ENGINE_THEN_EXIT = """
import sys, time
import gemma4_mlx
chat = gemma4_mlx.Chat.load(sys.argv[1])
chat.ask("hi", max_tokens=3, temperature=0.8)
chat.engine._submit(lambda: time.sleep(1))  # the engine's thread is still busy when...
del chat  # ...the engine is freed: its thread ends after this job, as the interpreter finalizes

class SlowToFinalize:
    def __del__(self, sleep=time.sleep):
        sleep(2)

slow = SlowToFinalize()
print("leaving")
"""


def test_the_thread_of_a_freed_engine_is_joined_at_exit(tmp_path):
    """An engine nobody holds is freed and its thread told to end; that thread is joined at exit
    too (before, it could end during finalization with traces in its compile cache: an abort)."""
    import subprocess

    from gemma4_mlx.testing import build_demo_checkpoint

    folder = build_demo_checkpoint(tmp_path / "demo")
    run = subprocess.run([sys.executable, "-c", FREE_ENGINE_THEN_EXIT, str(folder)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "leaving" and "terminate called" not in run.stderr


def test_an_unused_engine_is_freed_with_its_thread(family_model):
    import gc
    import weakref

    model, processor = family_model
    engine = ChatEngine(model, processor)
    list(engine.stream([{"role": "user", "content": "hi"}], max_tokens=2))
    thread, ref = engine._worker, weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None
    thread.join(10)
    assert not thread.is_alive()
