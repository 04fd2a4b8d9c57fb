"""What the chat page runs on: the model loaded in the background, and conversions between the
page's chat history (Gradio messages) and the model's conversation (chat-template messages).

The page's history is the single source of truth: each turn is rebuilt from it, so regenerate, edit,
undo and a reloaded page need no other state, and the engine's prefix cache makes rebuilding cheap.
"""

from __future__ import annotations

import hashlib
import html
import json
import mimetypes
import re
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from gemma4_mlx.generation.chat import ChatEngine
from gemma4_mlx.modalities import MODALITIES, supported
from gemma4_mlx.ops.compiled import release_thread

DEFAULT_MODEL = "google/gemma-4-E2B-it"
CACHE_DIR = Path("~/.cache/gemma4-mlx").expanduser()

# Titles of the blocks the page shows besides answers (assistant messages with metadata).
THINKING_TITLE = "Reasoning"
TOOL_TITLE = "Tool call: "
TOOL_RESULT_TITLE = "Tool result: "  # a user message sent as the result of the reply's tool call
STATS_TITLE = "Stats: "
# The app's own notes (errors, waiting) are assistant messages marked by their metadata id; they are
# never sent to the model. They are HTML with a class the page's CSS styles (see app/ui.py).
ERROR_NOTE = "app-note-error"
WAIT_NOTE = "app-note-wait"
E2B_DOWNLOAD = "about 10 GB (E2B in bf16: 10.2 GB)"
KEPT_CONVERSATIONS = 4  # KV caches the engine keeps, one per recent conversation (see ChatEngine)


class ModelUnavailable(Exception):
    """An expected failure to get the model (no Hub access, no such folder): said plainly, no traceback."""


class _Cancelled(Exception):
    """The app is exiting: the download or conversion in progress stops."""


class ModelHolder:
    """Loads the model once, in a background thread, and reports progress for the page."""

    def __init__(
        self, model: str | None, quantize_bits: int | None, demo: bool = False, dtype: str | None = None, draft: str | bool = True,
        group=None, parallel: str = "pipeline", split: str | None = None,
    ):  # fmt: skip
        """``draft``: the drafter for speculative decoding, a folder or Hub id; True looks for the
        model's own assistant (``<repo>-assistant`` on the Hub, or a ``<folder>-assistant`` folder
        beside a local model) and goes on without one if there is none; False: no drafter.
        ``group`` (several processes under ``mlx.launch``): this process loads its part of the model
        (``parallel``, ``split``: see :func:`gemma4_mlx.distributed.load_sharded`)."""
        self.group, self.parallel, self.split = group, parallel, split
        self.source = model
        self.quantize_bits = quantize_bits
        self.demo = demo
        self.dtype = dtype
        self.draft = draft
        self.drafter_name: str | None = None  # the drafter in use, once loaded
        self.status = "Starting…"
        self.error: str | None = None
        self.engine: ChatEngine | None = None
        self.ready = threading.Event()
        self.name = "demo (tiny random model)" if demo else (model or DEFAULT_MODEL)
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._downloading = False

    def start(self) -> "ModelHolder":
        # A daemon thread, so that a load cannot keep the process alive; close() stops it at exit.
        self._thread = threading.Thread(target=self._load, name="model-loader", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 30.0) -> bool:
        """Stop a download or conversion in progress and wait for the loading thread (at exit: a
        thread killed inside MLX or while writing files aborts the process or leaves half a
        conversion). Loading itself cannot be interrupted; it is waited for. True if it ended."""
        self._closing.set()
        if self._downloading:
            return False  # not waited for: huggingface_hub resumes a cut download on the next run
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _load(self) -> None:
        try:
            import gemma4_mlx

            if self.demo:
                from gemma4_mlx.testing import build_demo_checkpoint

                self.status = "Building the tiny demo model…"
                # Kept for the life of the process (the PLE table stays memory-mapped from it),
                # removed at exit by TemporaryDirectory's finalizer.
                self._demo_folder = tempfile.TemporaryDirectory(prefix="gemma4-demo-")
                path = build_demo_checkpoint(Path(self._demo_folder.name))
            else:
                path = self._converted_path()
            self.status = f"Loading {self.name}…"
            tic = time.perf_counter()
            if self.group is not None:
                from gemma4_mlx.distributed import load_sharded

                model, processor = load_sharded(path, self.group, parallel=self.parallel, split=self.split, dtype=self.dtype)
            else:
                model, processor = gemma4_mlx.load(path, dtype=self.dtype)
            drafter, why_not = self._drafter(model)
            # The page's conversations and the API's clients share the engine: it keeps the KV
            # caches of several recent conversations, within a quarter of the device's memory.
            from gemma4_mlx.memory import device_memory

            self.engine = ChatEngine(model, processor, draft_model=drafter, max_caches=KEPT_CONVERSATIONS, cache_memory=device_memory() // 4)
            with_drafter = f", drafting with {self.drafter_name}" if drafter is not None else (f" ({why_not})" if why_not else "")
            shared = ""
            if self.group is not None:  # under mlx.launch
                how = model.stage.describe() if model.stage is not None else "every layer split"
                shared = f", {self.parallel} over {self.group.size()} processes ({how})"
            self.status = f"Ready: {self.name} ({time.perf_counter() - tic:.1f} s to load){shared}{with_drafter}"
        except _Cancelled:
            self.error = "the app is exiting"
            self.status = f"Not loaded: {self.error}"
        except ModelUnavailable as e:  # expected (offline, a mistyped folder): advice, no traceback
            self.error = str(e)
            self.status = f"Could not load {self.name}: {self.error}"
            print(f"\n{self.status}\n", file=sys.stderr, flush=True)
        except Exception as e:  # shown in the page; the app keeps running
            if self._closing.is_set():  # a conversion stopped by close() (it removes its partial output)
                self.error = "the app is exiting"
                self.status = f"Not loaded: {self.error}"
                return
            traceback.print_exc()
            self.error = f"{type(e).__name__}: {e}"
            self.status = f"Could not load {self.name}: {self.error}"
        finally:
            self.ready.set()
            release_thread()  # before close()'s join returns: see gemma4_mlx.ops.compiled

    def _drafter(self, model):
        """``(drafter or None, why there is none)``: see ``draft`` in the constructor. A drafter that
        cannot be found or does not fit the model leaves the app running without one."""
        from gemma4_mlx import DrafterMismatchError, load_drafter
        from gemma4_mlx.loading import resolve_model_path

        if self.draft is False or (self.draft is True and self.demo):
            return None, ""
        explicit = isinstance(self.draft, str)
        if explicit:
            candidate = self.draft
        else:
            source = self.source or DEFAULT_MODEL
            folder = Path(source).expanduser()
            candidate = str(folder.parent / f"{folder.name}-assistant") if folder.exists() else f"{source}-assistant"
        try:
            self.status = f"Loading the drafter {candidate}…"
            drafter = load_drafter(resolve_model_path(candidate, progress=self._download_progress))
            drafter.check_target(model.text_config, name=f"the drafter {candidate}")
        except (OSError, ValueError) as e:
            if not explicit and not isinstance(e, DrafterMismatchError):
                return None, "no drafter found"  # the model has no assistant here: fine
            print(f"\nNot using the drafter: {e}\n", file=sys.stderr, flush=True)
            return None, f"no drafter: {e}"
        self.drafter_name = candidate
        return drafter, ""

    def _converted_path(self) -> str | Path:
        """The model to load; HF checkpoints are converted (and cached) first when quantizing."""
        source = self.source or DEFAULT_MODEL
        folder = Path(source).expanduser()
        if not self.quantize_bits:
            return self._resolve(source)
        config_file = folder / "config.json"
        config = json.loads(config_file.read_text()) if folder.is_dir() and config_file.exists() else {}
        if config.get("quantization"):
            return source  # already converted
        target = conversion_cache_path(source, self.quantize_bits)
        if (target / "config.json").exists():
            return target
        from convert import convert

        self.status = f"Downloading {source} (first use)…"
        local = self._resolve(source)
        if json.loads((local / "config.json").read_text()).get("quantization"):
            return local
        self.status = f"Converting {source} to {self.quantize_bits}-bit (first use; cached in {target})…"
        convert(str(local), target, quantize=True, q_bits=self.quantize_bits, progress=self._progress)
        return target

    def _resolve(self, source: str) -> Path:
        """A local folder, or a Hub repo id downloaded; a clear ModelUnavailable when neither works."""
        from gemma4_mlx.loading import resolve_model_path

        self._downloading = True
        try:
            return resolve_model_path(source, progress=self._download_progress)
        except FileNotFoundError as e:
            raise ModelUnavailable(unavailable_advice(source, str(e))) from None
        finally:
            self._downloading = False

    def _download_progress(self, bar: str) -> None:
        self.status = f"Downloading {self.source or DEFAULT_MODEL} (first use): {bar}"

    def _progress(self, message: str) -> None:
        if self._closing.is_set():
            raise _Cancelled
        self.status = f"Converting to {self.quantize_bits}-bit: {message}"

    @property
    def kv_group_size(self) -> int:
        """The quantized KV cache's group size: 64 (mlx-lm's), or 32 where the heads are narrower
        (the demo model)."""
        dims = {s.head_dim for s in self.engine.model.text_config.layers} if self.engine is not None else set()
        return 64 if all(d % 64 == 0 for d in dims) else 32

    @property
    def capabilities(self) -> dict[str, bool]:
        if self.engine is None:
            return {"image": False, "audio": False, "video": False}
        m = self.engine.model
        return supported(m)


def conversion_cache_path(source: str, bits: int) -> Path:
    """Where a conversion of ``source`` is cached: one folder per source, named so a person can
    tell them apart. A Hub id keeps its owner (``google--gemma-4-E2B-it-4bit``); a local folder
    is keyed by its absolute path (``gemma-4-E2B-it-local-1a2b3c4d-4bit``), so a fine-tune in
    ``./gemma-4-E2B-it`` and the Hub's ``google/gemma-4-E2B-it`` never share an entry."""
    folder = Path(source).expanduser()
    if folder.exists():
        resolved = str(folder.resolve())
        digest = hashlib.sha256(resolved.encode()).hexdigest()[:8]
        name = f"{folder.resolve().name}-local-{digest}"
    else:
        name = source.strip("/").replace("/", "--")
    return CACHE_DIR / f"{name}-{bits}bit"


def unavailable_advice(source: str, error: str) -> str:
    """What failed and what to do, for a model that could not be found or downloaded."""
    is_default = source == DEFAULT_MODEL
    lines = [error[:1].upper() + error[1:] + "."]
    if not Path(source).expanduser().exists() and "/" in source and not source.startswith((".", "/", "~")):
        size = f" ({E2B_DOWNLOAD}, then converted to 4-bit once)" if is_default else ""
        lines.append(f"The first run downloads the model from the Hugging Face Hub{size}; this needs a network connection.")
    lines.append("To try the app without a download: python -m app --demo")
    lines.append("To use a model you already have: python -m app --model /path/to/folder "
                 "(a folder from python -m convert, or a Hugging Face checkpoint folder)")  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------------- history conversion
IMAGE_EXT = {".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff"}
AUDIO_EXT = {".wav", ".mp3", ".flac", ".ogg", ".m4a", ".aac", ".opus", ".webm"}
VIDEO_EXT = {".mp4", ".mov", ".avi", ".mkv", ".m4v"}


def media_kind(path: str, mime: str | None = None) -> str | None:
    """'image', 'audio' or 'video' for an uploaded file (by MIME type, then extension)."""
    mime = mime or mimetypes.guess_type(path)[0] or ""
    ext = Path(path).suffix.lower()
    for kind in ("image", "audio", "video"):
        if mime.startswith(kind + "/"):
            # Browsers record the microphone as audio/webm or audio/wav; webm video is rarer in chat.
            return kind
    if ext in IMAGE_EXT:
        return "image"
    if ext in AUDIO_EXT:
        return "audio"
    if ext in VIDEO_EXT:
        return "video"
    return None


def message_parts(content) -> list[dict]:
    """A Gradio message's content as a list of {'type': 'text'|'file', ...} parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, dict):
        content = [content]
    parts = []
    for item in content:
        if isinstance(item, str):
            parts.append({"type": "text", "text": item})
        elif isinstance(item, dict) and item.get("type") == "text":
            parts.append(item)
        elif isinstance(item, dict) and item.get("type") == "file":
            f = item.get("file")
            parts.append({**item, "file": {"path": f} if isinstance(f, str) else (f or {})})  # gradio_client sends paths
        elif isinstance(item, dict) and "path" in item:
            parts.append({"type": "file", "file": item})
        elif isinstance(item, (tuple, list)) and item:
            parts.append({"type": "file", "file": {"path": item[0]}})
    return parts


def message_text(message: dict) -> str:
    return "".join(p["text"] for p in message_parts(message.get("content")) if p["type"] == "text")


class ToolsError(ValueError):
    """Tool definitions the app cannot use; the message says what to write instead."""


TOOLS_EXAMPLE = '{"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}'


def parse_tools(text: str | None) -> list[dict] | None:
    """The settings' tool definitions as the chat template takes them (``{"type": "function",
    "function": {...}}``), from JSON holding a function declaration (``{"name", "description",
    "parameters"}``), that form wrapped as ``{"type": "function", "function": ...}``, a list of
    either, or ``{"function_declarations": [...]}``. None when empty; ToolsError when unusable."""
    if not text or not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolsError(f"The tool definitions are not valid JSON: {e.msg} (line {e.lineno}, column {e.colno}).") from None
    if isinstance(value, dict):
        decls = value.get("function_declarations", value.get("functionDeclarations"))
        value = decls if isinstance(decls, list) else [value]
    if not isinstance(value, list):
        raise ToolsError(f"The tool definitions must be a function declaration or a list of them, like {TOOLS_EXAMPLE}")
    tools = []
    for i, item in enumerate(value, start=1):
        decl = item.get("function") if isinstance(item, dict) and item.get("type") == "function" else item
        if not isinstance(decl, dict) or not isinstance(decl.get("name"), str) or not decl["name"].strip():
            raise ToolsError(f"Tool {i} has no \"name\". Each tool is a function declaration, like {TOOLS_EXAMPLE}")
        params = decl.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolsError(f"The \"parameters\" of tool {decl['name']!r} must be a JSON schema object, like {{\"type\": \"object\", \"properties\": {{...}}}}.")
        tools.append({"type": "function", "function": {**decl, "description": str(decl.get("description", "")), "parameters": params}})
    return tools or None


def note(text: str, heading: str = "Could not reply", kind: str = ERROR_NOTE) -> dict:
    """An app note in the chat (not a reply): a short heading and the full message, styled by kind."""
    role = "alert" if kind == ERROR_NOTE else "status"
    body = html.escape(text).replace("\n", "<br>")
    content = f'<div class="app-note {kind}" role="{role}"><strong>{html.escape(heading)}</strong><br>{body}</div>'
    return {"role": "assistant", "content": content, "metadata": {"id": kind}}


def note_kind(message: dict) -> str | None:
    kind = (message.get("metadata") or {}).get("id")
    return kind if message.get("role") == "assistant" and kind in (ERROR_NOTE, WAIT_NOTE) else None


def note_text(message: dict) -> tuple[str, str]:
    """(heading, text) of a note made by :func:`note`."""
    m = re.search(r"<strong>(.*?)</strong><br>(.*)</div>", message_text(message), re.S)
    if not m:
        return "", message_text(message)
    return html.unescape(m.group(1)), html.unescape(m.group(2).replace("<br>", "\n"))


def file_names(history: list[dict], text: str) -> str:
    """``text`` with the server's paths of the conversation's files replaced by the files' names."""
    for message in history:
        for part in message_parts(message.get("content")):
            if part["type"] == "file" and part["file"].get("path"):
                path = part["file"]["path"]
                text = text.replace(path, part["file"].get("orig_name") or Path(path).name)
    return text


def pending_tool_calls(history: list[dict]) -> list[str]:
    """Names of the tool calls the last reply ended with, when they have no result yet."""
    calls: list[str] = []
    for message in reversed(history):
        title = (message.get("metadata") or {}).get("title") or ""
        if message.get("role") == "user" or note_kind(message):
            break
        if title.startswith(TOOL_TITLE):
            calls.insert(0, title[len(TOOL_TITLE):])
        elif not title:
            break  # an answer after the call: the model went on without a result (e.g. stopped)
    return calls


def calls_label(calls: list[str]) -> str:
    """The pending calls' names for the page ("the tool" for a call whose name did not parse)."""
    return ", ".join(c if c and c != "?" else "the tool" for c in calls) or "the tool"


def tool_result_message(text: str, calls: list[str]) -> dict:
    """A user message that answers the last reply's tool call(s) (see :func:`to_model_messages`)."""
    return {"role": "user", "content": text, "metadata": {"title": TOOL_RESULT_TITLE + ", ".join(calls)}}


def to_model_messages(history: list[dict], system: str | None = None) -> list[dict[str, Any]]:
    """The page's history -> chat-template messages.

    Reasoning and statistics blocks are display-only; tool-call blocks become the assistant turn's
    ``tool_calls``; a tool result (a user message titled "Tool result: ...") becomes that turn's
    ``tool_responses``, which Gemma 4's template renders as ``<|tool_response>`` in the model's own
    turn, the reply then going on in the same turn; an app note drops itself, and an error note also
    the user message it answered. Answer text goes back exactly as the model wrote it.
    """
    messages: list[dict[str, Any]] = [{"role": "system", "content": system.strip()}] if system and system.strip() else []
    for message in history:
        role = message.get("role")
        title = (message.get("metadata") or {}).get("title") or ""
        kind = note_kind(message)
        if kind:
            if kind == ERROR_NOTE and messages and messages[-1]["role"] == "user":
                messages.pop()
            continue
        if role == "user" and title.startswith(TOOL_RESULT_TITLE) and _answer_tool_calls(messages, message_text(message)):
            continue
        if role == "user":
            content: list[dict[str, Any]] = []
            for part in message_parts(message.get("content")):
                if part["type"] == "text":
                    if part["text"].strip():
                        content.append({"type": "text", "text": part["text"]})
                else:
                    f = part["file"]
                    path = f.get("path") or ""
                    if not Path(path).is_file():
                        # An upload from an earlier run of the app, restored with the page: the server
                        # no longer has it. Say so in its place rather than failing every later turn.
                        content.append({"type": "text", "text": f"[{f.get('orig_name') or Path(path).name}: file no longer available]"})
                        continue
                    content.append({"type": media_kind(path, f.get("mime_type")) or "unknown", "path": path})
            # Consecutive user messages (text, then files) form one turn.
            if messages and messages[-1]["role"] == "user":
                messages[-1]["content"] += content
            else:
                messages.append({"role": "user", "content": content})
        elif role == "assistant":
            if title.startswith((THINKING_TITLE, STATS_TITLE)):
                continue
            turn = _assistant_turn(messages)
            if title.startswith(TOOL_TITLE):
                turn.setdefault("tool_calls", []).append(_tool_call(title[len(TOOL_TITLE):], message_text(message)))
            else:
                turn["content"] += message_text(message)
    for m in messages:  # plain strings for text-only turns, as most templates expect
        if m["role"] == "user" and all(p["type"] == "text" for p in m["content"]):
            m["content"] = "\n".join(p["text"] for p in m["content"])
    return messages


def _tool_call(name: str, body: str) -> dict:
    """A tool-call block back into a template tool call; a block that is not the JSON the app wrote
    (an older or edited history) goes back as its text rather than failing the conversation."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        call = None
    if not isinstance(call, dict) or not isinstance(call.get("arguments", {}), dict):
        return {"type": "function", "function": {"name": name, "arguments": body}}
    return {"type": "function", "function": {"name": call.get("name") or name, "arguments": call.get("arguments", {})}}


def _answer_tool_calls(messages: list[dict], text: str) -> bool:
    """Attach a tool result to the assistant turn whose calls it answers (False if there is none).

    A JSON object becomes the result's fields; anything else is passed as text. Several calls take
    a JSON list with one result each (otherwise every call gets the whole message)."""
    if not messages or messages[-1]["role"] != "assistant" or not messages[-1].get("tool_calls"):
        return False
    turn = messages[-1]
    calls = turn["tool_calls"]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if len(calls) > 1 and isinstance(value, list) and len(value) == len(calls):
        results = value
    else:
        results = [value if isinstance(value, dict) else text] * len(calls)
    results = [r if isinstance(r, (dict, str)) else json.dumps(r) for r in results]
    if turn["content"]:
        # The template renders a turn's tool calls before its text and ends the turn after text,
        # so text written before the call moves to a turn of its own; the reply that follows the
        # result then continues the tool call's turn, as it was generated.
        messages.insert(len(messages) - 1, {"role": "assistant", "content": turn["content"]})
        turn["content"] = ""
    turn["tool_responses"] = [{"name": c["function"]["name"], "response": r} for c, r in zip(calls, results)]
    return True


def _assistant_turn(messages: list[dict]) -> dict:
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def unsupported_media(messages: list[dict], capabilities: dict[str, bool]) -> str | None:
    """A message for media the model cannot take (or files that are not media), else None."""
    for m in messages:
        if m["role"] != "user" or isinstance(m["content"], str):
            continue
        for part in m["content"]:
            kind = part["type"]
            if kind == "text":
                continue
            name = Path(part["path"]).name  # Gradio keeps the uploaded file's name in its copy
            if kind == "unknown":
                return f"{name} is not an image, audio or video file."
            if kind in capabilities and not capabilities[kind]:
                return f"This model has no {MODALITIES[kind].tower} encoder, so it cannot take {kind} input ({name})."
    return None


def to_markdown(history: list[dict], model_name: str) -> str:
    """The conversation as a Markdown document (for export)."""
    lines = [f"# Chat with {model_name}", ""]
    for message in history:
        title = (message.get("metadata") or {}).get("title") or ""
        text = message_text(message)
        files = [p["file"].get("orig_name") or Path(p["file"].get("path", "")).name for p in message_parts(message.get("content")) if p["type"] == "file"]
        if message.get("role") == "user" and title.startswith(TOOL_RESULT_TITLE):
            lines.append(f"**{title}**\n\n```\n{text}\n```")
        elif message.get("role") == "user":
            lines.append("**You:** " + text)
            lines += [f"*attached: {f}*" for f in files]
        elif note_kind(message):
            heading, body = note_text(message)
            lines.append(f"> **{heading}:** " + body.replace("\n", "\n> "))
        elif title.startswith(THINKING_TITLE):
            lines.append("<details><summary>Reasoning</summary>\n\n" + text + "\n\n</details>")
        elif title.startswith(STATS_TITLE):
            lines.append(f"<sub>{title[len(STATS_TITLE):]}</sub>")
        elif title:
            lines.append(f"**{title}**\n\n```\n{text}\n```")
        else:
            lines.append("**Gemma:** " + text)
        lines.append("")
    return "\n".join(lines)
