"""The OpenAI-compatible API served by the app (app/api.py), driven with the official ``openai``
client and with raw HTTP against the tiny demo model."""

import base64
import io
import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from fastapi import FastAPI
from fastapi.testclient import TestClient
from helpers import WEATHER, endless_replies, launch, scripted
from PIL import Image

from app.api import StopStrings, make_router
from app.backend import ModelHolder
from gemma4_mlx.generation.prompt_cache import PromptCachePool

pytestmark = pytest.mark.usefixtures("app_cache")
KEY = "test-key"
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server():
    holder = ModelHolder(None, None, demo=True).start()
    app, url = launch(holder, api=make_router(holder, api_key=KEY))
    assert holder.ready.wait(120) and holder.engine is not None, holder.status
    yield holder, url + "v1"
    app.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[1], api_key=KEY, max_retries=0, timeout=120)


def engine_reply(holder, messages, **options):
    """What the chat engine replies directly (greedy), for comparison."""
    chunk = None
    for chunk in holder.engine.stream(messages, temperature=0.0, **options):
        pass
    return chunk


def test_models_and_a_greedy_reply_equal_the_engines(server, client):
    holder, _ = server
    assert [m.id for m in client.models.list().data] == [holder.name]
    r = client.chat.completions.create(model="any", messages=HELLO, max_tokens=10, temperature=0)
    want = engine_reply(holder, HELLO, max_tokens=10, reuse=False)
    assert r.choices[0].message.content == want.reply.content and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == want.stats.prompt_tokens and r.usage.completion_tokens == 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10


def test_streaming_gives_the_same_reply_with_usage_last(client):
    whole = client.chat.completions.create(model="any", messages=HELLO, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="any", messages=HELLO, max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_server_sent_events_framing(server):
    _, url = server
    body = {"model": "any", "messages": HELLO, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ") and json.loads(e[6:])["object"] == "chat.completion.chunk"


def test_text_completions_continue_the_raw_prompt(server, client):
    holder, _ = server
    r = client.completions.create(model="any", prompt="Once upon a time", max_tokens=6, temperature=0)
    want = engine_reply(holder, "Once upon a time", max_tokens=6, reuse=False)
    assert r.choices[0].text == want.reply.content and r.object == "text_completion"
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="any", prompt="Once upon a time", max_tokens=6, temperature=0, stream=True))
    assert streamed == r.choices[0].text


@pytest.mark.parametrize(
    "headers,status",
    [({}, 401), ({"Authorization": "Bearer wrong"}, 401), ({"Authorization": f"Bearer {KEY}"}, 200)],
)
def test_the_api_key(server, headers, status):
    r = httpx.post(f"{server[1]}/chat/completions", json={"messages": HELLO, "max_tokens": 2}, headers=headers, timeout=60)
    assert r.status_code == status
    if status == 401:
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"messages": HELLO, "n": 2}, 400, "n"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
        ({"messages": HELLO, "temperature": -1}, 400, None),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}, 400, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}]}]}, 400, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "word " * 9000}]}, 413, "messages"),
    ],
)
def test_errors_have_openai_shape_and_status(server, client, body, status, param):
    r = httpx.post(f"{server[1]}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["param"] == param
    assert client.chat.completions.create(model="any", messages=HELLO, max_tokens=2).choices  # still serving


def test_a_body_that_is_not_json(server):
    r = httpx.post(f"{server[1]}/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_a_model_still_loading_answers_503():
    holder = ModelHolder(None, None, demo=True)  # never started
    app = FastAPI()
    app.include_router(make_router(holder))
    r = TestClient(app).post("/v1/chat/completions", json={"messages": HELLO})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def test_an_image_and_an_audio_clip(client):
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(png, format="PNG")
    wav = io.BytesIO()
    sf.write(wav, (0.3 * np.sin(np.arange(16000) / 16000 * 2 * np.pi * 440)).astype(np.float32), 16000, format="WAV")
    text_only = client.chat.completions.create(model="any", messages=HELLO, max_tokens=2, temperature=0).usage.prompt_tokens
    content = [
        {"type": "image_url", "image_url": {"url": data_url(png.getvalue(), "image/png")}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(), "format": "wav"}},
        {"type": "text", "text": "Hello there"},
    ]
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": content}], max_tokens=3, temperature=0,
                                       extra_body={"max_soft_tokens": 70})  # fmt: skip
    assert r.choices[0].message.content is not None
    assert r.usage.prompt_tokens > text_only + 70  # the image's soft tokens and the clip's


def test_a_tool_round_trip(server, client, monkeypatch):
    holder, _ = server
    engine = holder.engine
    seen = []
    original = engine.stream
    monkeypatch.setattr(engine, "stream", scripted(engine, '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'))
    tools = [{"type": "function", "function": WEATHER}]
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id.startswith("call_")

    monkeypatch.setattr(engine, "stream", scripted(engine, '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>'))
    chunks = list(client.chat.completions.create(model="any", messages=[{"role": "user", "content": "And Oslo?"}], tools=tools, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [(0, "get_weather", {"city": "Oslo"})]

    def recording(messages, **options):
        seen.append(messages)
        return scripted(engine, "It is sunny.", stream=original)(messages, **options)

    monkeypatch.setattr(engine, "stream", recording)
    back = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(model="any", messages=back, tools=tools)
    assert r.choices[0].message.content == "It is sunny."
    assert seen[0][1]["tool_responses"] == [{"name": "get_weather", "response": {"temperature": 21}}]


def test_thinking_comes_back_apart_from_the_answer(server, client, monkeypatch):
    holder, _ = server
    engine = holder.engine
    seen = []
    script = scripted(engine, "<|channel>thought\nLet me see.<channel|>Four.")
    monkeypatch.setattr(engine, "stream", lambda messages, **o: seen.append(o) or script(messages, **o))
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "2+2?"}], reasoning_effort="high")
    message = r.choices[0].message
    assert message.content == "Four." and message.reasoning_content == "Let me see." and message.reasoning == "Let me see."
    assert seen[-1]["enable_thinking"] is True
    client.chat.completions.create(model="any", messages=HELLO, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert seen[-1]["enable_thinking"] is False


def test_stop_strings_end_the_answer(server, client, monkeypatch):
    engine = server[0].engine
    monkeypatch.setattr(engine, "stream", scripted(engine, "one two three four"))
    r = client.chat.completions.create(model="any", messages=HELLO, stop=["three"])
    assert r.choices[0].message.content == "one two " and r.choices[0].finish_reason == "stop"
    cut = StopStrings(["END"])
    assert cut.feed("abc E") == "abc " and cut.feed("N") == "" and cut.feed("D more") == "" and cut.done


def test_a_second_request_reuses_the_first_ones_cache(client, server):
    """The second turn of a conversation continues the first's KV cache (cached tokens reported) and
    replies as a fresh computation does."""
    holder, _ = server
    first = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=8, temperature=0)
    conversation = [
        {"role": "user", "content": "Tell me a story"},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Go on"},
    ]
    second = client.chat.completions.create(model="any", messages=conversation, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    fresh = engine_reply(holder, conversation, max_tokens=8, reuse=False)
    assert second.choices[0].message.content == fresh.reply.content


def test_a_client_that_leaves_mid_stream_frees_the_engine(server, client):
    holder, url = server
    engine = holder.engine
    with endless_replies(engine):
        body = {"messages": HELLO, "max_tokens": 5000, "stream": True}
        with httpx.stream("POST", f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
            lines = r.iter_lines()
            while not next(lines).startswith('data: {"id"') or len(engine._running) == 0:
                pass
        deadline = time.monotonic() + 10
        while engine._running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine._running  # generation stopped
    assert client.chat.completions.create(model="any", messages=HELLO, max_tokens=2).choices


def test_three_concurrent_clients_get_their_own_replies(server, client):
    prompts = [[{"role": "user", "content": f"Question number {i}"}] for i in range(3)]
    alone = [client.chat.completions.create(model="any", messages=p, max_tokens=6, temperature=0).choices[0].message.content for p in prompts]
    together = [None] * 3

    def ask(i):
        together[i] = client.chat.completions.create(model="any", messages=prompts[i], max_tokens=6, temperature=0).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone


def test_the_cache_pool_keeps_conversations_apart(e2b):
    """Conversations alternating keep their own caches (one sharing a system prompt too); a new turn
    or an edited last message continues its own; with the pool full, the least recently used goes."""
    T = 7  # the turn marker
    pool = PromptCachePool(e2b.model, size=2, turn_start_id=T)
    a_ids = [2, T, 50, 51, T, 60, 61, T, 70, 71, T, 62, T, 72]  # system, user, model, user, model
    a = pool.take(a_ids)
    a.ids = a_ids
    b = pool.take([2, T, 50, 51, T, 90, 91])  # the same system prompt, another question
    assert b is not a
    b.ids = [2, T, 50, 51, T, 90, 91, T, 92]
    assert pool.take(a_ids + [T, 80]) is a  # a new turn of the first conversation
    assert pool.take([2, T, 50, 51, T, 60, 61, T, 70, 71, T, 99]) is a  # its last message edited
    assert pool.take([2, T, 55]) is b  # a third conversation, the pool full: the least recently used
    assert pool.latest is b


def test_a_video_as_a_file_part_and_as_a_video_url(client, tmp_path):
    import av

    path = tmp_path / "clip.mp4"
    frames = np.random.default_rng(0).integers(0, 256, (8, 48, 64, 3), dtype=np.uint8)
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=4)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for f in frames:
            for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    url = data_url(path.read_bytes(), "video/mp4")
    text_only = client.chat.completions.create(model="any", messages=HELLO, max_tokens=2, temperature=0).usage.prompt_tokens
    for part in ({"type": "file", "file": {"file_data": url, "filename": "clip.mp4"}}, {"type": "video_url", "video_url": {"url": url}}):
        content = [part, {"type": "text", "text": "Hello there"}]
        r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": content}], max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens > text_only + 8  # the frames' soft tokens
