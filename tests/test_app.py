"""The Gradio app, driven over HTTP with gradio_client (and in headless Chromium, see
test_app_browser.py) against the tiny random demo model."""

import contextlib
import functools
import json
import socket
import time

import mlx.core as mx
import numpy as np
import pytest
import soundfile as sf
from gradio_client import Client, handle_file
from helpers import WEATHER, endless_replies, free_port, launch, scripted
from PIL import Image

from app.backend import (
    ERROR_NOTE,
    STATS_TITLE,
    ModelHolder,
    media_kind,
    note,
    note_kind,
    note_text,
    to_markdown,
    to_model_messages,
    unsupported_media,
)
from app.ui import Replies, build_app

pytestmark = pytest.mark.usefixtures("app_cache")  # the app's cache in a temporary folder


@pytest.fixture(scope="module")
def demo_app():
    holder = ModelHolder(None, None, demo=True).start()
    app, url = launch(holder)
    assert holder.ready.wait(120) and holder.engine is not None, holder.status
    yield holder, url
    app.close()


@pytest.fixture
def client(demo_app):
    return Client(demo_app[1], verbose=False)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(folder / "picture.png")
    sf.write(folder / "tone.wav", (0.3 * np.sin(np.arange(12000) / 16000 * 2 * np.pi * 440)).astype(np.float32), 16000)
    (folder / "broken.png").write_bytes(b"this is not a png")
    return folder


def resend(history):
    """History as the client sends it back (files re-uploaded, as the page does)."""
    out = []
    for m in history:
        content = [{**p, "file": handle_file(p["file"])} if p.get("type") == "file" else p for p in m["content"]]
        out.append({**m, "content": content})
    return out


def chat(client, text, history=(), files=(), temperature=0.0, max_tokens=8, system="", tools="", **kwargs):
    message = {"text": text, "files": [handle_file(str(f)) for f in files]}
    history, box = client.predict(message, resend(history), system, temperature, 0.95, 64, max_tokens, False, 280, tools, api_name="/chat", **kwargs)
    return history


def title(m):
    return (m.get("metadata") or {}).get("title") or ""


def is_error(m):
    return note_kind(m) == ERROR_NOTE


def error_text(m):
    heading, body = note_text(m)
    return heading + ": " + body


def text(m):
    return "".join(p.get("text", "") for p in m["content"])


def test_text_turn_streams_a_reply_with_stats(client):
    job = client.submit({"text": "hello there", "files": []}, [], "", 0.0, 0.95, 64, 12, False, 280, "", api_name="/chat")
    history = job.result()[0]
    updates = job.outputs()
    assert len(updates) > 3  # streamed: the message, the first token, the last, the stats
    assert [m["role"] for m in history] == ["user", "assistant", "assistant"]
    assert text(history[0]) == "hello there" and text(history[1])
    assert title(history[2]).startswith(STATS_TITLE) and "tok/s" in title(history[2])


def test_a_long_reply_reaches_the_page_in_timed_updates_and_whole(demo_app, client):
    """The page gets a reply about 20 times a second, not at every token (it renders the whole
    reply on each update), and the last update holds all of it."""
    from app.ui import UPDATE_INTERVAL

    holder, _ = demo_app
    words = " ".join(f"word{i}" for i in range(400))
    with recording(holder.engine, words):
        tic = time.perf_counter()
        job = client.submit({"text": "count", "files": []}, [], "", 0.0, 0.95, 64, 4000, False, 280, "", api_name="/chat")
        history = job.result()[0]
        elapsed = time.perf_counter() - tic
    generated = int(text(history[-1]).split("generation: ")[1].split(" tokens")[0])
    assert generated > 800  # the demo writes ~250 tokens/s: per token, ~5 times the updates allowed
    assert 3 < len(job.outputs()) <= elapsed / UPDATE_INTERVAL + 4
    assert text(history[1]) == words


def test_kv_cache_setting(demo_app, client):
    """The conversation's KV cache setting reaches the engine: an 8-bit turn leaves a quantized
    cache, and reused it on the next 8-bit turn; back to exact, a fresh unquantized one."""
    from mlx_lm.models.cache import QuantizedKVCache

    def turn(history, kv_cache):
        message = {"text": "hello there", "files": []}
        return client.predict(message, resend(history), "", 0.0, 0.95, 64, 6, False, 280, "", True, kv_cache, api_name="/chat")[0]

    quantized = lambda: any(isinstance(c, QuantizedKVCache) for c in demo_app[0].engine.prompt_cache.cache)  # noqa: E731
    history = turn([], "8-bit")
    assert not any(is_error(m) for m in history) and quantized()
    history = turn(history, "8-bit")
    assert " 0 reused" not in text(history[-1]) and quantized()
    history = turn(history, "exact")
    assert not any(is_error(m) for m in history) and not quantized()


def test_multimodal_turn_and_prefix_reuse(client, media):
    history = chat(client, "hello")
    history = chat(client, "what do you see and hear?", history, files=[media / "picture.png", media / "tone.wav"])
    assert not any(is_error(m) for m in history), [text(m) for m in history]
    stats = text(history[-1])
    reused = int(stats.split("prompt: ")[1].split(" tokens, ")[1].split(" reused")[0])
    assert reused > 0  # the first turn was not prefilled again
    # Media in an earlier turn keep working in later turns.
    history = chat(client, "and now?", history)
    assert not any(is_error(m) for m in history)


def test_regenerate_gives_the_same_greedy_reply(client):
    history = chat(client, "tell me a story", max_tokens=10)
    answer = text(history[-2])
    again = client.predict(resend(history), "", 0.0, 0.95, 64, 10, False, 280, "", api_name="/regenerate")
    assert text(again[-2]) == answer
    assert len(again) == len(history)


def test_stop_mid_stream(demo_app, client):
    holder, _ = demo_app
    with endless_replies(holder.engine):
        job = client.submit({"text": "go on forever", "files": []}, [], "", 1.0, 0.95, 64, 8000, False, 280, "", api_name="/chat")
        while len(job.outputs()) < 5:
            time.sleep(0.05)
        client.predict(api_name="/stop")
        tic = time.time()
        history = job.result(timeout=30)[0]
        assert time.time() - tic < 10
    assert "stopped" in title(history[-1])
    generated = int(text(history[-1]).split("generation: ")[1].split(" tokens")[0])
    assert generated < 8000
    # The app keeps working, and the stopped reply is part of the conversation.
    history = chat(client, "next", history)
    assert title(history[-1]).startswith(STATS_TITLE)


def test_stop_applies_to_the_reply_asked_for_before_it_and_undo_or_clear_to_its_save():
    """Stop pressed while the page's reply waits for the model stops it as it begins; a Stop from
    before the request does not, nor one before an API call. Undo and Clear pressed since a reply
    was asked for keep that reply from saving its conversation over theirs."""
    from types import SimpleNamespace

    replies, page, api = Replies(), SimpleNamespace(session_hash="page"), SimpleNamespace(session_hash="api")
    replies.asked(page)
    replies.stop(page)  # while the reply waits in the queue
    assert replies.begin(page).is_set()
    replies.ended(page)
    replies.stop(page)
    replies.asked(page)  # the next reply, asked for after that Stop
    assert not replies.begin(page).is_set() and replies.busy(page)
    assert not replies.replaced_since_reply(page)
    replies.replace(page)  # Clear during the reply: it stops, and Clear's conversation is saved
    assert replies.stop_event(page).is_set() and replies.replaced_since_reply(page)
    replies.ended(page)
    assert not replies.busy(page)
    replies.asked(page)
    assert not replies.begin(page).is_set() and not replies.replaced_since_reply(page)
    replies.stop(api)
    assert not replies.begin(api).is_set()  # an API call has no page step before it: it begins anew
    assert not replies.stop_event(page).is_set()  # sessions are apart


def test_bad_inputs_give_clear_messages(client, media):
    history = chat(client, "look", files=[media / "broken.png"])
    assert is_error(history[-1])
    assert "broken.png" in error_text(history[-1])
    # The conversation goes on; the failed turn is not sent to the model again.
    history = chat(client, "hello", history)
    assert title(history[-1]).startswith(STATS_TITLE)
    long = chat(client, "word " * 9000)
    assert is_error(long[-1]) and "context" in error_text(long[-1])
    bad_tools = client.predict({"text": "hi", "files": []}, [], "", 0.0, 0.95, 64, 8, False, 280, "[not json", api_name="/chat")[0]
    assert "not valid JSON" in error_text(bad_tools[-1])


def test_undo_and_export(client):
    history = chat(client, "first")
    history = chat(client, "second", history)
    undone, box = client.predict(resend(history), api_name="/undo")
    assert [text(m) for m in undone if m["role"] == "user"] == ["first"]
    assert box["text"] == "second"
    path = client.predict(resend(history), api_name="/export")
    markdown = open(path, encoding="utf-8").read()
    assert "**You:** first" in markdown and "**You:** second" in markdown


def test_model_that_fails_to_load(tmp_path):
    holder = ModelHolder(str(tmp_path / "no-such-model"), None).start()
    app, url = launch(holder)
    try:
        assert holder.ready.wait(60) and holder.engine is None
        history = chat(Client(url, verbose=False), "hello")
        assert is_error(history[-1])
        assert "Could not load" in error_text(history[-1]) and "no-such-model" in error_text(history[-1])
    finally:
        app.close()


# ---------------------------------------------------------------------------- history conversion
def test_history_to_model_messages(tmp_path):
    for name in ("a.png", "b.wav"):
        (tmp_path / name).write_bytes(b"")
    history = [
        {"role": "user", "content": [{"type": "file", "file": {"path": str(tmp_path / "a.png")}}]},
        {"role": "user", "content": [{"type": "text", "text": "what is it"}]},
        {"role": "assistant", "content": "thinking...", "metadata": {"title": "Reasoning"}},
        {"role": "assistant", "content": "A cat."},
        {"role": "assistant", "content": json.dumps({"name": "f", "arguments": {"a": 1}}), "metadata": {"title": "Tool call: f"}},
        {"role": "assistant", "content": "- stats", "metadata": {"title": STATS_TITLE + "1 s"}},
        {"role": "user", "content": "and this?"},
        {"role": "user", "content": [{"type": "file", "file": {"path": str(tmp_path / "b.wav")}}]},
        note("cannot", "no audio"),
        {"role": "user", "content": "plain"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "file", "file": {"path": "/gone/old.png", "orig_name": "old.png"}}]},
    ]
    messages = to_model_messages(history, system="be kind")
    assert messages[0] == {"role": "system", "content": "be kind"}
    assert messages[1] == {"role": "user", "content": [{"type": "image", "path": str(tmp_path / "a.png")}, {"type": "text", "text": "what is it"}]}
    assert messages[2]["content"] == "A cat." and messages[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
    assert messages[3] == {"role": "user", "content": "plain"}  # the failed turn is dropped
    assert messages[5] == {"role": "user", "content": "[old.png: file no longer available]"}  # a restored, vanished upload
    assert len(messages) == 6
    assert "**Gemma:** A cat." in to_markdown(history, "m")


def test_unsupported_media_and_kinds():
    messages = [{"role": "user", "content": [{"type": "audio", "path": "/x/rec.webm"}]}]
    assert "no audio encoder" in unsupported_media(messages, {"image": True, "audio": False, "video": True})
    assert unsupported_media(messages, {"image": True, "audio": True, "video": True}) is None
    assert "not an image" in unsupported_media([{"role": "user", "content": [{"type": "unknown", "path": "/x/a.pdf"}]}], {})
    assert media_kind("rec.webm", "audio/webm") == "audio" and media_kind("clip.mp4") == "video" and media_kind("a.JPG") == "image"


def test_reasoning_and_tool_call_blocks(demo_app, client):
    """A sampler that plays back a fixed reply shows how the page lays out reasoning, answer and a tool call."""
    holder, _ = demo_app
    engine = holder.engine
    processor = engine.processor
    script = processor.encode('<|channel>thought\nweather needed<channel|>Checking.<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>', add_special_tokens=False)
    end = processor.tokenizer.convert_tokens_to_ids("<turn|>")
    it = iter(script)
    original = engine.stream
    engine.stream = functools.partial(original, sampler=lambda logprobs: mx.array([next(it, end)]))
    try:
        history = chat(client, "weather in Oslo?", max_tokens=200)
    finally:
        engine.stream = original
    titles = [title(m) for m in history[1:]]
    assert titles[0] == "Reasoning" and text(history[1]) == "weather needed"
    assert titles[1] == "" and text(history[2]) == "Checking."
    assert titles[2] == "Tool call: get_weather" and json.loads(text(history[3])) == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert "waiting for the result of get_weather" in titles[3]
    # The call goes back to the model as the assistant turn's tool_calls.
    messages = to_model_messages(history)
    assert messages[-1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


def test_first_use_conversion_is_cached(tmp_path, monkeypatch):
    """An unquantized checkpoint is converted once (``--quantize 8``), then loaded from the cache."""
    from checkpoints import build_hf_model, save_checkpoint

    import app.backend

    monkeypatch.setattr(app.backend, "CACHE_DIR", tmp_path / "cache")
    source = save_checkpoint(build_hf_model("e2b"), tmp_path / "hf-e2b")
    holder = ModelHolder(str(source), 8).start()
    assert holder.ready.wait(120) and holder.engine is not None, holder.status
    converted = app.backend.conversion_cache_path(str(source), 8)
    assert converted.parent == tmp_path / "cache" and converted.name.startswith("hf-e2b-local-")
    config = json.loads((converted / "config.json").read_text())
    assert config["quantization"]["bits"] == 8
    assert holder.status.startswith("Ready")
    stamp = (converted / "config.json").stat().st_mtime
    again = ModelHolder(str(source), 8).start()
    assert again.ready.wait(120) and again.engine is not None
    assert (converted / "config.json").stat().st_mtime == stamp  # not converted twice


def test_hub_download_progress_shows_in_the_status(tmp_path, monkeypatch):
    """A Hub id is downloaded with huggingface_hub; its byte counter reaches the page's status line."""
    import shutil

    import huggingface_hub
    from checkpoints import build_hf_model, save_checkpoint

    import app.backend

    monkeypatch.setattr(app.backend, "CACHE_DIR", tmp_path / "cache")
    source = save_checkpoint(build_hf_model("e2b"), tmp_path / "hf-e2b")
    seen = []

    def fake_snapshot_download(repo_id, tqdm_class=None, **kwargs):  # no network here: the Hub call is faked
        bar = tqdm_class(total=2_000_000, unit="B", unit_scale=True, desc="Downloading bytes")
        bar.update(1_000_000)
        bar.refresh()
        seen.append(holder.status)
        bar.close()
        return str(shutil.copytree(source, tmp_path / "snapshot" / repo_id))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    holder = ModelHolder("someone/gemma-4-tiny", 8)  # bound before the loading thread starts: the fake reads it
    holder.start()
    assert holder.ready.wait(120) and holder.engine is not None, holder.status
    assert seen and seen[0].startswith("Downloading someone/gemma-4-tiny (first use): Downloading bytes")
    assert "1.00M/2.00M" in seen[0]
    assert (tmp_path / "cache" / "someone--gemma-4-tiny-8bit" / "config.json").exists()


# ---------------------------------------------------------------------------- conversations kept by the browser
def test_browser_secret_is_kept_per_user(tmp_path):
    """The page's stored conversations are encrypted with a secret that survives a restart: kept in
    the cache folder, readable by the user only, created once even by two apps starting together."""
    import os
    import stat
    from concurrent.futures import ThreadPoolExecutor

    from app.store import browser_secret

    with ThreadPoolExecutor(8) as pool:
        secrets = set(pool.map(lambda _: browser_secret(tmp_path / "c"), range(16)))
    assert len(secrets) == 1 and len(secrets.pop()) >= 32
    path = tmp_path / "c" / "browser-secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(tmp_path / "c") == ["browser-secret"]  # no temporary files left behind
    assert browser_secret(tmp_path / "c") == path.read_text().strip()
    # Two apps built one after the other (a restart) give their BrowserState the same secret.
    holder = ModelHolder(None, None, demo=True)
    first, second = build_app(holder), build_app(holder)
    secret = lambda app: next(b.secret for b in app.blocks.values() if type(b).__name__ == "BrowserState")  # noqa: E731
    assert secret(first) == secret(second)


def test_conversation_store():
    from app import store

    s = store.normalize({"conversations": "junk", "active": 3})  # anything a browser may send
    assert len(s["conversations"]) == 1 and s["active"] == s["conversations"][0]["id"]
    first = s["active"]
    s = store.save(s, [{"role": "user", "content": "What is a monad, in plain words please?"}], {"system": "Be brief.", "thinking": True, "top_k": "bad"})
    conv = store.active(s)
    assert conv["settings"]["system"] == "Be brief." and conv["settings"]["thinking"] is True
    assert conv["settings"]["top_k"] == store.SETTINGS_DEFAULTS["top_k"]  # a wrong type falls back
    assert store.clean_settings({"kv_cache": "3-bit"})["kv_cache"] == "exact"  # and so does an unknown choice
    assert store.choices(s) == [("What is a monad, in plain words please?", first)]
    s = store.start_new(s, conv["settings"])
    second = s["active"]
    assert second != first and store.active(s)["settings"]["system"] == "Be brief."  # a new chat keeps the setup
    s = store.start_new(s, store.SETTINGS_DEFAULTS)  # the empty new chat is not kept twice
    assert len(s["conversations"]) == 2
    s = store.save(s, [{"role": "user", "content": "x" * 100}], store.SETTINGS_DEFAULTS)
    assert store.choices(s)[0][0] == "x" * 40 + "…"
    s = store.switch(s, first)
    assert store.active(s)["settings"]["system"] == "Be brief."
    s = store.rename(s, "  Monads  ")
    assert dict((i, label) for label, i in store.choices(s))[first] == "Monads"
    s = store.delete(s)
    assert [c["id"] for c in s["conversations"]] != [] and first not in [c["id"] for c in s["conversations"]]
    s = store.delete(s)  # the last one: a new, empty conversation takes its place
    assert len(s["conversations"]) == 1 and store.active(s)["history"] == []


def test_conversation_events_fired_together_do_not_undo_each_other():
    """Clicking New chat while the name box has focus fires a rename (its blur) and New chat with
    the same store; a setting's blur comes with a click on another conversation. Each event once
    changed the store it was sent, so the answer handled last undid the other, and a rename
    handled after New chat made the old conversation active again behind the new one's empty
    page: the next save wrote the new page over it (CI's test_conversations_settings_export_and_restart
    found its list wrong). Through the app's own handlers, in both orders."""
    import types

    from app import store as convs

    def handlers():
        app = build_app(ModelHolder(None, None, demo=True))
        return {f.fn.__name__: f.fn for f in app.fns.values() if hasattr(f.fn, "__name__")}

    def store_of(outputs):  # what an answer leaves in the page's store (None: left as it was)
        first = outputs[0]
        return None if isinstance(first, dict) and first.get("__type__") == "update" else first

    settings = list(convs.SETTINGS_DEFAULTS.values())
    question = [{"role": "user", "content": "What is a monad?"}, {"role": "assistant", "content": "A pattern."}]
    for rename_last in (True, False):
        fn = handlers()
        request = types.SimpleNamespace(session_hash="tab")
        page = convs.save(convs.normalize(None), question, convs.SETTINGS_DEFAULTS)
        first = page["active"]
        # Fired together, with the page's store as it was; the page keeps the answer handled last.
        renamed = lambda: fn["rename"](request, page, "Monads")  # noqa: E731
        new = lambda: fn["new_chat"](request, page, question, *settings)  # noqa: E731
        answers = [new(), renamed()] if rename_last else [renamed(), new()]
        page = next(s for s in map(store_of, reversed(answers)) if s is not None)
        second = page["active"]
        assert second != first, "the page shows the new chat, and its store says so"
        # A setting of the new chat, then its first message (the page's send: add_message, save).
        brief = dict(convs.SETTINGS_DEFAULTS, system="Be brief.")
        page = store_of(fn["save_settings"](request, page, *brief.values())) or page
        page = fn["save"](request, page, [{"role": "user", "content": "Second"}], *brief.values())[0]
        assert [label for label, _ in convs.choices(page)] == ["Second", "Monads"]
        assert convs.find(page, first)["history"] == question and convs.find(page, first)["settings"]["system"] == ""
        assert convs.find(page, second)["settings"]["system"] == "Be brief." and page["active"] == second

    # A setting's blur (of the conversation shown) and a click on another conversation, in both orders.
    for blur_last in (True, False):
        fn = handlers()
        request = types.SimpleNamespace(session_hash="tab")
        page = convs.save(convs.normalize(None), question, convs.SETTINGS_DEFAULTS)
        other = page["active"]
        page = fn["new_chat"](request, page, question, *settings)[0]
        second = [{"role": "user", "content": "Second"}]
        page = fn["save"](request, page, second, *settings)[0]
        pirate = list(dict(convs.SETTINGS_DEFAULTS, system="You are a pirate.").values())
        switched = lambda: fn["switch"](request, page, second, other, *pirate)  # noqa: E731
        blurred = lambda: fn["save_settings"](request, page, *pirate)  # noqa: E731
        answers = [switched(), blurred()] if blur_last else [blurred(), switched()]
        page = next(s for s in map(store_of, reversed(answers)) if s is not None)
        assert page["active"] == other, "the page's store shows the conversation the page shows"
        assert convs.find(page, other)["history"] == question and convs.find(page, other)["settings"]["system"] == ""
        assert [(c["history"], c["settings"]["system"]) for c in page["conversations"] if c["id"] != other] == [(second, "You are a pirate.")]

    # A server restart: the page's store is newer than anything the (new) server has seen.
    fn = handlers()
    kept = fn["rename"](request, page, "Pirates")[0]
    assert kept["revision"] == page["revision"] + 1 and convs.title(convs.active(kept)) == "Pirates"
    assert store_of(fn["rename"](request, kept, "Pirates")) is None  # unchanged: no answer to land late


def test_conversion_cache_is_keyed_by_the_full_source(tmp_path, monkeypatch):
    """Two sources with the same last path component never share a converted folder."""
    import app.backend
    from app.backend import conversion_cache_path

    monkeypatch.setattr(app.backend, "CACHE_DIR", tmp_path / "cache")
    mine = tmp_path / "work" / "gemma-4-E2B-it"
    other = tmp_path / "elsewhere" / "gemma-4-E2B-it"
    for folder in (mine, other):
        folder.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    paths = {
        conversion_cache_path("google/gemma-4-E2B-it", 4),
        conversion_cache_path("./gemma-4-E2B-it", 4),
        conversion_cache_path(str(other), 4),
        conversion_cache_path("org1/x", 4),
        conversion_cache_path("org2/x", 4),
    }
    assert len(paths) == 5
    assert conversion_cache_path("google/gemma-4-E2B-it", 4).name == "google--gemma-4-E2B-it-4bit"
    assert conversion_cache_path("./gemma-4-E2B-it", 4) == conversion_cache_path(str(mine), 4)  # the same folder, however named
    assert conversion_cache_path(str(mine), 4).name.startswith("gemma-4-E2B-it-local-")
    assert conversion_cache_path(str(mine), 8) != conversion_cache_path(str(mine), 4)


# ---------------------------------------------------------------------------- math in replies
def test_display_math_round_trips_exactly():
    """Replies are shown with their rule-following $...$ as \\(...\\); the text goes back unchanged."""
    import random

    from app.mathtext import MARK, from_display, to_display

    examples = {
        "Prices: $5 and $10.": "Prices: $5 and $10.",
        "from $20,000 to $30,000": "from $20,000 to $30,000",
        "between $5-$10": "between $5-$10",
        "area $\\pi r^2$ here": "area \\(\\pi r^2\\) here",
        "$$E = mc^2$$": "$$E = mc^2$$",
        "`echo $HOME` and `$x$`": "`echo $HOME` and `$x$`",
        "```sh\nA=$1; B=$2$\n```": "```sh\nA=$1; B=$2$\n```",
        "model's own \\(x\\)": "model's own \\(" + MARK + "x\\)",
        "escaped \\$5 and $x$": "escaped \\$5 and \\(x\\)",
    }
    for text, shown in examples.items():
        assert to_display(text) == shown, text
        assert from_display(shown) == text
    atoms = ["$", "$$", "\\", "\\(", "\\)", "(", ")", " ", "\n", "`", "```", "~~~", "a", "1", "\\relax", MARK, "{", "}"]
    rng = random.Random(0)
    for _ in range(20000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 24)))
        assert from_display(to_display(text)) == text, repr(text)


@contextlib.contextmanager
def recording(engine, reply_text=None):
    """Records the conversations the engine is asked to answer (and scripts its reply)."""
    original = engine.stream
    seen = []
    seen_options = recording.options = []

    def stream(messages, **options):
        seen.append(json.loads(json.dumps(messages)))
        seen_options.append(options)
        fn = scripted(engine, reply_text, original) if reply_text is not None else original
        return fn(messages, **options)

    engine.stream = stream
    try:
        yield seen
    finally:
        engine.stream = original


def test_replies_go_back_to_the_model_exactly(demo_app, client):
    """The page shows $...$ math as \\(...\\) and keeps "$5 and $10" as text, but the next turn
    sends the model the reply exactly as it was generated (its KV cache is matched on it)."""
    holder, _ = demo_app
    reply = "It costs $5 and $10; the area is $\\pi r^2$ and \\(x\\)."
    with recording(holder.engine, reply):
        history = chat(client, "prices?", max_tokens=100)
    shown = text(history[1])
    assert "$5 and $10" in shown and "\\(\\pi r^2\\)" in shown and "$\\pi" not in shown
    with recording(holder.engine) as seen:
        chat(client, "and then?", history)
    assert seen[0][1] == {"role": "assistant", "content": reply}


# ---------------------------------------------------------------------------- tools
def test_tool_definitions_in_either_form():
    from app.backend import ToolsError, parse_tools

    wrapped = {"type": "function", "function": WEATHER}
    expected = [wrapped]
    for form in (WEATHER, [WEATHER], wrapped, [wrapped], {"function_declarations": [WEATHER]}):
        assert parse_tools(json.dumps(form)) == expected, form
    assert parse_tools(json.dumps([WEATHER, {"name": "now"}]))[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert parse_tools("  ") is None
    for bad, words in (("[not json", "not valid JSON"), ('"get_weather"', "function declaration"), ('[{"description": "x"}]', 'Tool 1 has no "name"'),
                       ('{"name": "f", "parameters": 3}', '"parameters" of tool')):  # fmt: skip
        with pytest.raises(ToolsError, match=words):
            parse_tools(bad)


def test_tools_and_their_problems_in_the_chat(demo_app, client):
    """A bare function declaration works; unusable tools give a readable note, not an error page,
    and the conversation goes on without the failed turn."""
    holder, _ = demo_app
    with recording(holder.engine, "Sure.") as seen:
        history = chat(client, "hi", tools=json.dumps(WEATHER))
    assert recording.options[0]["tools"] == [{"type": "function", "function": WEATHER}]
    assert title(history[-1]).startswith(STATS_TITLE)
    bad = client.predict({"text": "weather?", "files": []}, resend(history), "", 0.0, 0.95, 64, 8, False, 280, '[{"description": "no name"}]', api_name="/chat")[0]
    assert is_error(bad[-1]) and 'Tool 1 has no "name"' in error_text(bad[-1])
    with recording(holder.engine, "Fine.") as seen:
        chat(client, "then without tools", bad)
    assert [m["content"] for m in seen[0] if m["role"] == "user"] == ["hi", "then without tools"]
    # A tool-call block that is not valid JSON (an edited or older history) is sent as its text.
    broken = history + [{"role": "assistant", "content": [{"type": "text", "text": "{not json"}], "metadata": {"title": "Tool call: f"}}]
    with recording(holder.engine, "Ok.") as seen:
        after = chat(client, "go on", broken)
    assert title(after[-1]).startswith(STATS_TITLE)
    assert seen[0][2]["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}]


def test_tool_call_and_result_round_trip(demo_app, client, media):
    """After a tool call the next message is the tool's result: shown as such, and sent to the model
    as the call's tool_responses, which the template renders as Gemma 4's <|tool_response>."""
    holder, _ = demo_app
    call = 'Checking.<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>'
    with recording(holder.engine, call):
        history = chat(client, "weather in Oslo?", tools=json.dumps(WEATHER), max_tokens=100)
    assert "your next message is sent as the tool's result" in title(history[-1])
    with recording(holder.engine, "It is 12 degrees.") as seen:
        history = chat(client, '{"temp_c": 12}', history, tools=json.dumps(WEATHER), max_tokens=100)
    result = history[len(history) - 3]
    assert result["role"] == "user" and title(result) == "Tool result: get_weather" and text(result) == '{"temp_c": 12}'
    messages = seen[0]
    assert messages[-2] == {"role": "assistant", "content": "Checking."}
    assert messages[-1]["tool_responses"] == [{"name": "get_weather", "response": {"temp_c": 12}}]
    assert messages[-1]["content"] == "" and messages[-1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    prompt = holder.engine.processor.apply_chat_template(messages, tools=[{"type": "function", "function": WEATHER}])
    tail = prompt[prompt.index("<|tool_call>") :]
    assert "<|tool_response>response:get_weather{temp_c:12}<tool_response|>" in tail
    assert "<|turn>" not in tail  # the reply goes on in the model's own turn
    assert text(history[-2]) == "It is 12 degrees."
    # The answer that followed the result belongs to that turn; a plain message comes after it.
    with recording(holder.engine, "Bye.") as seen:
        chat(client, "thanks", history, tools=json.dumps(WEATHER))
    assert seen[0][-2]["content"] == "It is 12 degrees." and seen[0][-1] == {"role": "user", "content": "thanks"}
    # Files cannot be a tool's result: a clear message, and nothing is added to the conversation.
    with recording(holder.engine, call):
        waiting = chat(client, "weather in Oslo?", tools=json.dumps(WEATHER), max_tokens=100)
    with pytest.raises(Exception, match="send the result as text"):
        chat(client, "here", waiting, files=[media / "picture.png"])


def test_error_notes_are_styled_and_name_the_users_file(client, media):
    history = chat(client, "look", files=[media / "broken.png"])
    upload = history[0]["content"][0]["file"]
    upload = upload if isinstance(upload, str) else upload["path"]
    note_message = history[-1]
    assert is_error(note_message) and not title(note_message)  # a note, not a reply or a collapsed block
    heading, body = note_text(note_message)
    assert heading == "Could not reply" and "broken.png" in body
    assert upload not in body and "/gradio/" not in body
    assert 'class="app-note app-note-error"' in text(note_message) and 'role="alert"' in text(note_message)
    assert "> **Could not reply:**" in to_markdown(history, "m")


# ---------------------------------------------------------------------------- python -m app as a user runs it
def run_app(tmp_path, *args, env=None):
    """``python -m app ARGS`` with its own home (cache) folder; stdout and stderr in one file."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    path = os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)  # keeps conftest's start-up guard
    env = {**os.environ, "HOME": str(tmp_path / "home"), "PYTHONPATH": path, "GRADIO_ANALYTICS_ENABLED": "False", **(env or {})}
    log = open(tmp_path / "app.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "app", "--no-browser", *args], cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, tmp_path / "app.log"


def wait_for(condition, timeout=120.0, proc=None):
    end = time.time() + timeout
    while not condition():
        assert proc is None or proc.poll() is None, "the app exited"
        assert time.time() < end, "timed out"
        time.sleep(0.2)


def test_busy_or_impossible_port_is_reported_plainly(capsys):
    from app.__main__ import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--demo", "--no-browser", "--port", str(port)]) == 2  # before anything starts
    err = capsys.readouterr().err
    assert f"port {port} is in use" in err and f"--port {port + 1}" in err
    for bad in ("99999", "0", "-1", "http"):
        with pytest.raises(SystemExit) as exit_:
            main(["--demo", "--port", bad])
        assert exit_.value.code == 2 and "a port is a number from 1 to 65535" in capsys.readouterr().err


def test_first_run_without_the_hub_says_what_to_do(tmp_path):
    """No Hub (offline, nothing cached): the terminal and the page say what failed and what to do."""
    port = free_port()
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc, log = run_app(tmp_path, "--port", str(port), env=env)
    try:
        wait_for(lambda: "python -m app --demo" in log.read_text() and "Running on local URL" in log.read_text(), proc=proc)
        output = log.read_text()
        assert "Could not load google/gemma-4-E2B-it" in output and "10.2 GB" in output and "--model /path/to/folder" in output
        assert "Traceback" not in output
        history = chat(Client(f"http://127.0.0.1:{port}/", verbose=False), "hello")
        heading, body = note_text(history[-1])
        assert heading == "The model is not loaded" and "python -m app --demo" in body and "10.2 GB" in body
    finally:
        proc.send_signal(2)
        proc.wait(60)


def test_ctrl_c_during_a_reply_exits_cleanly(tmp_path):
    """SIGINT while a reply streams: the app stops the reply and the model thread and exits with 0
    (not abort's 134 from a thread killed inside MLX)."""
    port = free_port()
    proc, log = run_app(tmp_path, "--demo", "--port", str(port))
    try:
        wait_for(lambda: "Running on local URL" in log.read_text(), proc=proc)
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        job = client.submit({"text": "go on", "files": []}, [], "", 0.0, 0.95, 64, 4000, False, 280, "", api_name="/chat")
        wait_for(lambda: len(job.outputs()) > 5, proc=proc)  # greedy demo replies run to max tokens
        proc.send_signal(2)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log.read_text()
    assert rc == 0, output[-3000:]
    assert "terminate called" not in output and "Traceback" not in output
