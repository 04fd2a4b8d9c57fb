"""The OpenAI-compatible API (``/v1``), served by the app on the FastAPI app Gradio runs on.

    python -m app                     # the page at /, the API at /v1
    python -m app --api-only          # the API alone
    python -m app --api-key SECRET    # requests need "Authorization: Bearer SECRET"

``/v1/models``, ``/v1/chat/completions`` (streamed as server-sent events or not; text, images, audio
and video parts; tools; reasoning returned apart as ``reasoning_content``) and ``/v1/completions``
(a raw prompt, no template). Every request goes through the page's own chat engine (one model, one
queue, first come first served), which keeps the KV caches of recent conversations and continues
the one that shares most of each prompt: ``usage.prompt_tokens_details.cached_tokens`` says how
many prompt tokens came from it. Errors come in OpenAI's shape with its status codes.

Written here because no library serves our engine: mlx-lm's server runs its own models (and refuses
images for Gemma 4). The request and response shapes follow the ``openai`` client's types.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import mimetypes
import secrets
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from gemma4_mlx.errors import ContextLengthError, MediaError, OptionError
from gemma4_mlx.processing.sources import MAX_DOWNLOAD_BYTES

from .backend import ModelHolder, media_kind

DEFAULT_MAX_TOKENS = 8192  # OpenAI's default is "until the context ends"; the engine clamps to it
THINKING_EFFORTS = {"none": False, "minimal": True, "low": True, "medium": True, "high": True, "xhigh": True}
FINISH_REASONS = {"stop": "stop", "length": "length", "tool_call": "tool_calls", "stopped": "stop"}


class APIError(Exception):
    """A request the API refuses, as OpenAI reports it: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")  # fmt: skip

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def api_error(e: BaseException) -> APIError:
    """The API's error for an exception raised while preparing or generating a reply."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextLengthError):
        return APIError(413, str(e), "messages", "context_length_exceeded")
    if isinstance(e, (OptionError, MediaError, ValueError)):
        return bad(str(e))
    return APIError(500, f"{type(e).__name__}: {e}")


# ------------------------------------------------------------------------------ requests


@dataclass
class CompletionRequest:
    """A chat or text completion request, checked and translated for the chat engine."""

    prompt: Any  # chat-template messages, or a string for /v1/completions
    options: dict[str, Any]  # ReplyOptions fields
    stream: bool = False
    include_usage: bool = False
    stops: list[str] = field(default_factory=list)
    media_dir: tempfile.TemporaryDirectory | None = None  # decoded data URLs, removed after the reply

    def close(self) -> None:
        if self.media_dir is not None:
            self.media_dir.cleanup()


def _get(body: dict, name: str, kinds: tuple, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__.replace("str", "a string").replace("dict", "an object").replace("list", "a list") for k in kinds)
        raise bad(f"'{name}' must be {names}, not {json.dumps(value)[:80]}", name)
    return value


NUMBER = (int, float)


def sampling_options(body: dict) -> dict[str, Any]:
    """The sampling fields both endpoints take, as ReplyOptions fields (range checks are the engine's)."""
    if _get(body, "n", (int,), 1) != 1:
        raise bad("only n=1 is supported: send one request per completion", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        if _get(body, name, NUMBER, 0) != 0:
            raise bad(f"'{name}' is not supported; use 'repetition_penalty' (1.0 is none)", name)
    if body.get("logprobs"):
        raise bad("'logprobs' are not supported", "logprobs")
    options: dict[str, Any] = {
        "temperature": _get(body, "temperature", NUMBER, 1.0),
        "top_p": _get(body, "top_p", NUMBER, 1.0),
        "top_k": _get(body, "top_k", (int,), 0),
        "min_p": _get(body, "min_p", NUMBER, 0.0),
        "max_tokens": _get(body, "max_completion_tokens", (int,)) or _get(body, "max_tokens", (int,)) or DEFAULT_MAX_TOKENS,
        "seed": _get(body, "seed", (int,)),
        "repetition_penalty": _get(body, "repetition_penalty", NUMBER),
    }
    return options


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop' must be a string or a list of non-empty strings", "stop")
    return stops


def chat_request(body: Any, allow_fetch: bool) -> CompletionRequest:
    """Check a /v1/chat/completions body and translate it (media parts decoded to temporary files)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    messages = _get(body, "messages", (list,))
    if not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages")
    options = sampling_options(body)
    thinking = False
    effort = _get(body, "reasoning_effort", (str,))
    if effort is not None:
        if effort not in THINKING_EFFORTS:
            raise bad(f"'reasoning_effort' must be one of {', '.join(THINKING_EFFORTS)}", "reasoning_effort")
        thinking = THINKING_EFFORTS[effort]
    template_kwargs = _get(body, "chat_template_kwargs", (dict,), {})
    if "enable_thinking" in template_kwargs:
        thinking = bool(template_kwargs["enable_thinking"])
    options["enable_thinking"] = thinking
    budget = _get(body, "max_soft_tokens", (int,))  # our extension: the image token budget
    if budget is not None:
        options["max_soft_tokens"] = budget
    response_format = _get(body, "response_format", (dict,), {"type": "text"})
    if response_format.get("type", "text") != "text":
        raise bad("only text responses are supported ('response_format' type 'text')", "response_format")
    options["tools"] = _tools(body)
    stream_options = _get(body, "stream_options", (dict,), {})
    media_dir = tempfile.TemporaryDirectory(prefix="gemma4-api-")
    try:
        prompt = engine_messages(messages, MediaFiles(Path(media_dir.name), allow_fetch))
    except BaseException:
        media_dir.cleanup()
        raise
    return CompletionRequest(prompt, options, bool(_get(body, "stream", (bool,), False)), bool(stream_options.get("include_usage")),
                             stop_strings(body), media_dir)  # fmt: skip


def text_request(body: Any) -> CompletionRequest:
    """Check a /v1/completions body: a raw prompt, continued as is (no chat template)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad("'prompt' must be a non-empty string (one prompt per request)", "prompt")
    if body.get("echo") or body.get("suffix"):
        raise bad("'echo' and 'suffix' are not supported")
    options = sampling_options(body)
    if "max_tokens" not in body:
        options["max_tokens"] = 16  # OpenAI's default for completions
    stream_options = _get(body, "stream_options", (dict,), {})
    return CompletionRequest(prompt, options, bool(_get(body, "stream", (bool,), False)), bool(stream_options.get("include_usage")), stop_strings(body))


def _tools(body: dict) -> list[dict] | None:
    tools = _get(body, "tools", (list,))
    choice = body.get("tool_choice", "auto")
    if not tools or choice == "none":
        return None
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(tool.get("function"), dict)
                and isinstance(tool["function"].get("name"), str)):  # fmt: skip
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}", "tools")
    if choice in ("auto", "required"):
        return tools
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise bad(f"'tool_choice' must be 'auto', 'none', 'required' or a function among 'tools', not {json.dumps(choice)[:80]}", "tool_choice")
    return named  # the model is offered that function alone


class MediaFiles:
    """Where a request's data URLs are decoded to (files the media loaders read)."""

    def __init__(self, folder: Path, allow_fetch: bool):
        self.folder, self.allow_fetch, self.count = folder, allow_fetch, 0

    def from_url(self, url: Any, param: str, kind: str | None = None) -> dict:
        if not isinstance(url, str) or not url:
            raise bad(f"'{param}' must be a URL string", param)
        if url.startswith("data:"):
            header, _, data = url.partition(",")
            mime = header[5:].split(";")[0]
            if ";base64" not in header:
                raise bad(f"'{param}': data URLs must be base64 encoded", param)
            return self.from_base64(data, mime, param, kind)
        if url.startswith(("http://", "https://")):
            if not self.allow_fetch:
                raise bad(f"'{param}': this server does not fetch URLs (start it with --allow-fetch), send a data URL instead", param)
            return {"type": kind or media_kind(url) or "image", "url": url}
        raise bad(f"'{param}' must be a data: URL{' or an http(s) URL' if self.allow_fetch else ''}", param)

    def from_base64(self, data: Any, mime: str, param: str, kind: str | None = None) -> dict:
        if not isinstance(data, str):
            raise bad(f"'{param}' must be base64 text", param)
        if len(data) * 3 // 4 > MAX_DOWNLOAD_BYTES:
            raise APIError(413, f"'{param}' is larger than {MAX_DOWNLOAD_BYTES // 2**20} MB", param)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise bad(f"'{param}' is not valid base64", param) from None
        kind = kind or media_kind("", mime)
        if kind is None:
            raise bad(f"'{param}': unsupported media type {mime!r} (images, audio and video are)", param)
        self.count += 1
        path = self.folder / f"{self.count}{mimetypes.guess_extension(mime) or ''}"
        path.write_bytes(raw)
        return {"type": kind, "path": str(path)}


def engine_messages(messages: list, media: MediaFiles) -> list[dict]:
    """OpenAI chat messages -> the engine's chat-template messages. A ``tool`` message becomes the
    ``tool_responses`` of the assistant turn whose call it answers, as Gemma 4's template wants."""
    out: list[dict] = []
    calls: dict[str, str] = {}  # tool_call_id -> function name
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", "messages")
        role = m.get("role")
        if role in ("system", "developer"):
            out.append({"role": "system", "content": _text_of(m.get("content"), where)})
        elif role == "user":
            out.append({"role": "user", "content": _user_content(m.get("content"), media, where)})
        elif role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": _text_of(m.get("content"), where, optional=True)}
            tool_calls = m.get("tool_calls") or []
            if tool_calls:
                turn["tool_calls"] = []
                for j, call in enumerate(tool_calls):
                    function = call.get("function") if isinstance(call, dict) else None
                    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                        raise bad(f"{where}.tool_calls[{j}] must have a function with a name", "messages")
                    arguments = function.get("arguments") or "{}"
                    try:
                        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
                    except json.JSONDecodeError:
                        pass  # rendered as the text it is
                    turn["tool_calls"].append({"type": "function", "function": {"name": function["name"], "arguments": arguments}})
                    calls[call.get("id") or ""] = function["name"]
            out.append(turn)
        elif role == "tool":
            turn = out[-1] if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") else None
            if turn is None:
                raise bad(f"{where}: a tool message must follow the assistant message whose tool call it answers", "messages")
            text = _text_of(m.get("content"), where)
            try:
                result = json.loads(text)
            except json.JSONDecodeError:
                result = text
            name = calls.get(m.get("tool_call_id") or "", turn["tool_calls"][0]["function"]["name"])
            turn.setdefault("tool_responses", []).append({"name": name, "response": result if isinstance(result, (dict, str)) else text})
        else:
            raise bad(f"{where}: unknown role {role!r} (system, developer, user, assistant, tool)", "messages")
    return out


def _text_of(content: Any, where: str, optional: bool = False) -> str:
    if content is None and optional:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise bad(f"{where}: content must be a string or a list of text parts", "messages")


def _user_content(content: Any, media: MediaFiles, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise bad(f"{where}: content must be a string or a non-empty list of parts", "messages")
    parts: list[dict] = []
    for j, part in enumerate(content):
        param = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise bad(f"{param}: a text part needs 'text'", "messages")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            parts.append(media.from_url(url.get("url") if isinstance(url, dict) else url, param, "image"))
        elif kind == "input_audio":
            audio = part.get("input_audio") or {}
            fmt = audio.get("format", "wav") if isinstance(audio, dict) else None
            if fmt not in ("wav", "mp3"):
                raise bad(f"{param}: input_audio format must be 'wav' or 'mp3'", "messages")
            parts.append(media.from_base64(audio.get("data"), f"audio/{'mpeg' if fmt == 'mp3' else 'wav'}", param, "audio"))
        elif kind == "video_url":
            url = part.get("video_url")
            parts.append(media.from_url(url.get("url") if isinstance(url, dict) else url, param, "video"))
        elif kind == "file":
            data = (part.get("file") or {}).get("file_data")
            parts.append(media.from_url(data, param))
        else:
            raise bad(f"{param}: unsupported part type {kind!r} (text, image_url, input_audio, video_url, file)", "messages")
    return parts


# ------------------------------------------------------------------------------ replies


class StopStrings:
    """Cuts the answer at the first stop string, holding back text that could begin one."""

    def __init__(self, stops: list[str]):
        self.stops, self.held, self.done = stops, "", False

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self.held += text
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.done = True
            out, self.held = self.held[:cut], ""
            return out
        keep = max((n for s in self.stops for n in range(1, len(s)) if self.held.endswith(s[:n])), default=0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


@dataclass
class Delta:
    """What one engine chunk adds to the reply, in OpenAI's terms."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[tuple[int, dict]] = field(default_factory=list)  # (index in the reply, call)
    finish_reason: str | None = None


class ReplyTranslator:
    """Engine chunks -> deltas: answer text cut at stop strings, reasoning apart, tool calls with ids."""

    def __init__(self, stops: list[str], stop_event: threading.Event):
        self.stops, self.stop_event = StopStrings(stops), stop_event
        self.tool_calls: list[dict] = []
        self.usage: dict | None = None

    def delta(self, chunk) -> Delta:
        d = Delta()
        if self.stops.done:
            pass
        elif chunk.part == "thinking":
            d.reasoning = chunk.text
        elif chunk.part == "answer":
            d.content = self.stops.feed(chunk.text)
            if self.stops.done:
                self.stop_event.set()  # the engine stops after this token
        for call in chunk.reply.tool_calls[len(self.tool_calls) :]:
            self.tool_calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                    "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}})  # fmt: skip
            d.tool_calls.append((len(self.tool_calls) - 1, self.tool_calls[-1]))
        s = chunk.stats
        self.usage = {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.generation_tokens,
                      "total_tokens": s.prompt_tokens + s.generation_tokens,
                      "prompt_tokens_details": {"cached_tokens": s.reused_tokens}}  # fmt: skip
        if chunk.finish_reason is not None:
            if not self.stops.done:
                d.content += self.stops.flush()
            d.finish_reason = "stop" if self.stops.done else FINISH_REASONS.get(chunk.finish_reason, "stop")
        return d


def _next(it: Iterator):
    return next(it, None)


# ------------------------------------------------------------------------------ the routes


def make_router(holder: ModelHolder, api_key: str | None = None, allow_fetch: bool = False) -> APIRouter:
    """The ``/v1`` routes over ``holder``'s chat engine; ``api_key``: required as a bearer token."""
    router = APIRouter(prefix="/v1")

    def check_key(request: Request) -> None:
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError(401, "a valid API key is required: 'Authorization: Bearer <key>'", code="invalid_api_key")

    def check(request: Request):
        """The engine, once the key (if any) is right and the model is loaded; else an APIError."""
        check_key(request)
        if holder.engine is None:
            message = holder.status if holder.error is None else f"the model could not be loaded: {holder.error}"
            raise APIError(503, f"the model is not ready: {message}", code="model_not_ready")
        return holder.engine

    async def body_of(request: Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise bad("the request body is not valid JSON") from None

    @router.get("/models")
    async def models(request: Request):
        try:
            check_key(request)
        except APIError as e:
            return e.response()
        return {"object": "list", "data": [{"id": holder.name, "object": "model", "created": int(time.time()), "owned_by": "gemma4-mlx"}]}

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        try:
            engine = check(request)
            req = chat_request(await body_of(request), allow_fetch)
        except APIError as e:
            return e.response()
        return await _respond(engine, req, "chat.completion")

    @router.post("/completions")
    async def completions(request: Request):
        try:
            engine = check(request)
            req = text_request(await body_of(request))
        except APIError as e:
            return e.response()
        return await _respond(engine, req, "text_completion")

    async def _respond(engine, req: CompletionRequest, kind: str):
        stop = threading.Event()
        translator = ReplyTranslator(req.stops, stop)
        it = engine.stream(req.prompt, stop_event=stop, **{k: v for k, v in req.options.items() if v is not None})
        ident = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
        created, name = int(time.time()), holder.name
        try:
            first = await run_in_threadpool(_next, it)  # errors in the prompt surface here, as a status
        except BaseException as e:
            req.close()
            return api_error(e).response()
        if not req.stream:
            try:
                chunks = [first] + await run_in_threadpool(list, it)
            except BaseException as e:
                return api_error(e).response()
            finally:
                req.close()
            return _whole(kind, ident, created, name, [translator.delta(c) for c in chunks if c is not None], translator)

        async def events():
            chunk = first
            try:
                if kind == "chat.completion":
                    yield _sse(_chunk(kind, ident, created, name, {"role": "assistant", "content": ""}))
                while chunk is not None:
                    d = translator.delta(chunk)
                    if d.content or d.reasoning or d.tool_calls or d.finish_reason:
                        yield _sse(_chunk(kind, ident, created, name, _delta_body(kind, d), d.finish_reason))
                    chunk = await run_in_threadpool(_next, it)
                if req.include_usage:
                    yield _sse({"id": ident, "object": _chunk_object(kind), "created": created, "model": name, "choices": [], "usage": translator.usage})
                yield "data: [DONE]\n\n"
            except Exception as e:  # after the headers: reported in the stream
                yield _sse(api_error(e).body())
            finally:
                stop.set()  # a client gone mid-stream: the engine stops after its current token
                with contextlib.suppress(Exception):
                    await run_in_threadpool(it.close)
                req.close()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return router


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _chunk_object(kind: str) -> str:
    return "chat.completion.chunk" if kind == "chat.completion" else "text_completion"


def _delta_body(kind: str, d: Delta) -> dict:
    if kind != "chat.completion":
        return {"text": d.content}
    body: dict[str, Any] = {}
    if d.content:
        body["content"] = d.content
    if d.reasoning:
        body["reasoning_content"] = body["reasoning"] = d.reasoning
    if d.tool_calls:
        body["tool_calls"] = [{"index": i, **call} for i, call in d.tool_calls]
    return body


def _chunk(kind: str, ident: str, created: int, name: str, delta: dict, finish: str | None = None) -> dict:
    choice = {"index": 0, "finish_reason": finish, **({"delta": delta} if kind == "chat.completion" else {**delta, "logprobs": None})}
    return {"id": ident, "object": _chunk_object(kind), "created": created, "model": name, "choices": [choice]}


def _whole(kind: str, ident: str, created: int, name: str, deltas: list[Delta], translator: ReplyTranslator) -> dict:
    content = "".join(d.content for d in deltas)
    finish = next((d.finish_reason for d in reversed(deltas) if d.finish_reason), "stop")
    if kind != "chat.completion":
        choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
    else:
        reasoning = "".join(d.reasoning for d in deltas)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning
        if translator.tool_calls:
            message["tool_calls"] = translator.tool_calls
        choice = {"index": 0, "message": message, "finish_reason": finish}
    return {"id": ident, "object": kind, "created": created, "model": name, "choices": [choice], "usage": translator.usage}
