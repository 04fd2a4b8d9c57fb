"""What the chat page runs on: the model loaded in the background, and conversions between the
page's chat history (Gradio messages) and the model's conversation (chat-template messages).

The page's history is the single source of truth: each turn is rebuilt from it, so regenerate, edit,
undo and a reloaded page need no other state, and the engine's prefix cache makes rebuilding cheap.
"""

from __future__ import annotations

import json
import mimetypes
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from gemma4_mlx.chat import ChatEngine

DEFAULT_MODEL = "google/gemma-4-E2B-it"
CACHE_DIR = Path("~/.cache/gemma4-mlx").expanduser()

# Titles of the blocks the page shows besides answers (assistant messages with metadata).
THINKING_TITLE = "Reasoning"
TOOL_TITLE = "Tool call: "
STATS_TITLE = "Stats: "
ERROR_TITLE = "Error: "
WAIT_TITLE = "Waiting: "


class ModelHolder:
    """Loads the model once, in a background thread, and reports progress for the page."""

    def __init__(self, model: str | None, quantize_bits: int | None, demo: bool = False, dtype: str | None = None):
        self.source = model
        self.quantize_bits = quantize_bits
        self.demo = demo
        self.dtype = dtype
        self.status = "Starting…"
        self.error: str | None = None
        self.engine: ChatEngine | None = None
        self.ready = threading.Event()
        self.name = "demo (tiny random model)" if demo else (model or DEFAULT_MODEL)

    def start(self) -> "ModelHolder":
        threading.Thread(target=self._load, name="model-loader", daemon=True).start()
        return self

    def _load(self) -> None:
        try:
            import gemma4_mlx

            if self.demo:
                from gemma4_mlx.tiny import build_demo_checkpoint

                self.status = "Building the tiny demo model…"
                # Kept for the life of the process (the PLE table stays memory-mapped from it),
                # removed at exit by TemporaryDirectory's finalizer.
                self._demo_folder = tempfile.TemporaryDirectory(prefix="gemma4-demo-")
                path = build_demo_checkpoint(Path(self._demo_folder.name))
            else:
                path = self._converted_path()
            self.status = f"Loading {self.name}…"
            tic = time.perf_counter()
            model, processor = gemma4_mlx.load(path, dtype=self.dtype)
            self.engine = ChatEngine(model, processor)
            self.status = f"Ready: {self.name} ({time.perf_counter() - tic:.1f} s to load)"
        except Exception as e:  # shown in the page; the app keeps running
            traceback.print_exc()
            self.error = f"{type(e).__name__}: {e}"
            self.status = f"Could not load {self.name}: {self.error}"
        finally:
            self.ready.set()

    def _converted_path(self) -> str | Path:
        """The model to load; HF checkpoints are converted (and cached) first when quantizing."""
        from gemma4_mlx.loading import resolve_model_path

        source = self.source or DEFAULT_MODEL
        if not self.quantize_bits:
            return source
        if Path(source).expanduser().is_dir():
            config = json.loads((Path(source).expanduser() / "config.json").read_text()) if (Path(source).expanduser() / "config.json").exists() else {}
        else:
            config = {}
        if config.get("quantization"):
            return source  # already converted
        target = CACHE_DIR / f"{Path(source).name}-{self.quantize_bits}bit"
        if (target / "config.json").exists():
            return target
        from convert import convert

        self.status = f"Downloading {source} (first use)…"
        local = resolve_model_path(source, progress=self._download_progress)
        if json.loads((local / "config.json").read_text()).get("quantization"):
            return local
        self.status = f"Converting {source} to {self.quantize_bits}-bit (first use; cached in {target})…"
        convert(str(local), target, quantize=True, q_bits=self.quantize_bits, progress=self._progress)
        return target

    def _download_progress(self, bar: str) -> None:
        self.status = f"Downloading {self.source or DEFAULT_MODEL} (first use): {bar}"

    def _progress(self, message: str) -> None:
        self.status = f"Converting to {self.quantize_bits}-bit: {message}"

    @property
    def capabilities(self) -> dict[str, bool]:
        if self.engine is None:
            return {"image": False, "audio": False, "video": False}
        m = self.engine.model
        return {"image": m.has_vision, "audio": m.has_audio, "video": m.has_vision}


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


def _parts(content) -> list[dict]:
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
            parts.append(item)
        elif isinstance(item, dict) and "path" in item:
            parts.append({"type": "file", "file": item})
        elif isinstance(item, (tuple, list)) and item:
            parts.append({"type": "file", "file": {"path": item[0]}})
    return parts


def message_text(message: dict) -> str:
    return "".join(p["text"] for p in _parts(message.get("content")) if p["type"] == "text")


def to_model_messages(history: list[dict], system: str | None = None) -> list[dict[str, Any]]:
    """The page's history -> chat-template messages.

    Reasoning and statistics blocks are display-only; tool-call blocks become the assistant turn's
    ``tool_calls``; an error note drops itself and the user message it answered.
    """
    messages: list[dict[str, Any]] = [{"role": "system", "content": system.strip()}] if system and system.strip() else []
    for message in history:
        role = message.get("role")
        title = (message.get("metadata") or {}).get("title") or ""
        if role == "user":
            content: list[dict[str, Any]] = []
            for part in _parts(message.get("content")):
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
            if title.startswith(ERROR_TITLE):
                if messages and messages[-1]["role"] == "user":
                    messages.pop()
                continue
            if title.startswith((THINKING_TITLE, STATS_TITLE, WAIT_TITLE)):
                continue
            turn = _assistant_turn(messages)
            if title.startswith(TOOL_TITLE):
                call = json.loads(message_text(message) or "{}")
                turn.setdefault("tool_calls", []).append(
                    {"type": "function", "function": {"name": call.get("name", ""), "arguments": call.get("arguments", {})}}
                )
            else:
                turn["content"] += message_text(message)
    for m in messages:  # plain strings for text-only turns, as most templates expect
        if m["role"] == "user" and all(p["type"] == "text" for p in m["content"]):
            m["content"] = "\n".join(p["text"] for p in m["content"])
    return messages


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
            if kind == "unknown":
                return f"{Path(part['path']).name} is not an image, audio or video file."
            if kind in capabilities and not capabilities[kind]:
                tower = "audio" if kind == "audio" else "vision"
                return f"This model has no {tower} encoder, so it cannot take {kind} input ({Path(part['path']).name})."
    return None


def to_markdown(history: list[dict], model_name: str) -> str:
    """The conversation as a Markdown document (for export)."""
    lines = [f"# Chat with {model_name}", ""]
    for message in history:
        title = (message.get("metadata") or {}).get("title") or ""
        text = message_text(message)
        files = [p["file"].get("orig_name") or Path(p["file"].get("path", "")).name for p in _parts(message.get("content")) if p["type"] == "file"]
        if message.get("role") == "user":
            lines.append("**You:** " + text)
            lines += [f"*attached: {f}*" for f in files]
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
