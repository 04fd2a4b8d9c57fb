"""The chat page (Gradio Blocks).

One generator, ``chat``, serves every turn: it adds the user's message to the history, rebuilds the
model conversation from the history, and streams the reply into it (reasoning and tool calls as
their own collapsible blocks, then a statistics line). Regenerate, edit and undo edit the history
and call the same code; the engine's prefix cache makes that cheap.
"""

from __future__ import annotations

import itertools
import json
import tempfile
import threading
from pathlib import Path

import gradio as gr

from gemma4_mlx.generate import ContextLengthError
from gemma4_mlx.multimodal import MediaError

from .backend import (
    ERROR_TITLE,
    STATS_TITLE,
    THINKING_TITLE,
    TOOL_TITLE,
    WAIT_TITLE,
    ModelHolder,
    message_text,
    to_markdown,
    to_model_messages,
    unsupported_media,
)

IMAGE_BUDGETS = [70, 140, 280, 560, 1120]
LATEX = [
    {"left": "$$", "right": "$$", "display": True},
    {"left": "\\[", "right": "\\]", "display": True},
    {"left": "$", "right": "$", "display": False},
    {"left": "\\(", "right": "\\)", "display": False},
]


def build_app(holder: ModelHolder) -> gr.Blocks:
    """The Blocks app for a model that ``holder`` loads in the background."""
    stop_events: dict[str, threading.Event] = {}
    # Exports are written here and copied into Gradio's cache; removed when the process exits.
    exports = tempfile.TemporaryDirectory(prefix="gemma4-chat-")
    export_count = itertools.count(1)

    def stop_event(request: gr.Request | None) -> threading.Event:
        key = request.session_hash if request is not None and request.session_hash else "default"
        return stop_events.setdefault(key, threading.Event())

    def respond(history, system, temperature, top_p, top_k, max_tokens, thinking, image_tokens, tools_json, request):
        """Stream the reply to the conversation in ``history`` (ending with the user's turn)."""
        if not holder.ready.is_set():
            yield history + [_note("Waiting for the model to load…", WAIT_TITLE)]
            holder.ready.wait()
        if holder.engine is None:
            yield history + [_note(holder.status)]
            return
        try:
            tools = json.loads(tools_json) if tools_json and tools_json.strip() else None
        except json.JSONDecodeError as e:
            yield history + [_note(f"The tool definitions are not valid JSON: {e}")]
            return
        messages = to_model_messages(history, system)
        problem = unsupported_media(messages, holder.capabilities)
        if problem:
            yield history + [_note(problem)]
            return
        stop = stop_event(request)
        stop.clear()
        reply_start = len(history)
        history = list(history)
        chunk = None
        try:
            stream = holder.engine.stream(
                messages, max_tokens=int(max_tokens), temperature=float(temperature), top_p=float(top_p),
                top_k=int(top_k), enable_thinking=bool(thinking), tools=tools,
                max_soft_tokens=int(image_tokens), stop_event=stop,
            )  # fmt: skip
            for chunk in stream:
                history[reply_start:] = _reply_messages(chunk.reply, done=chunk.finish_reason is not None)
                yield history
        except (MediaError, ContextLengthError, ValueError, OSError, RuntimeError) as e:
            del history[reply_start:]
            yield history + [_note(str(e))]
            return
        if chunk is not None:
            s = chunk.stats
            why = {"length": " · stopped at max tokens", "stopped": " · stopped", "tool_call": " · waiting for a tool result"}
            title = STATS_TITLE + s.summary() + why.get(chunk.finish_reason, "")
            history.append({"role": "assistant", "content": _stats_detail(s, chunk.finish_reason), "metadata": {"title": title, "status": "done"}})
        yield history

    settings = []  # filled below, in the order `respond` takes them

    def chat(message, history, system, temperature, top_p, top_k, max_tokens, thinking, image_tokens, tools_json, request: gr.Request):
        """Add the user's message (text and files) to the history and stream the reply."""
        message = message or {}
        text = (message.get("text") or "").strip() if isinstance(message, dict) else str(message).strip()
        files = message.get("files", []) if isinstance(message, dict) else []
        if not text and not files:
            yield history, gr.update()
            return
        history = list(history or [])
        for f in files:
            path = f if isinstance(f, str) else f.get("path")
            history.append({"role": "user", "content": {"path": path}})
        if text:
            history.append({"role": "user", "content": text})
        yield history, gr.update(value=None)
        for h in respond(history, system, temperature, top_p, top_k, max_tokens, thinking, image_tokens, tools_json, request):
            yield h, gr.update()

    def regenerate(history, system, temperature, top_p, top_k, max_tokens, thinking, image_tokens, tools_json, request: gr.Request):
        """Drop everything after the last user message and reply again."""
        history = list(history or [])
        last_user = max((i for i, m in enumerate(history) if m["role"] == "user"), default=None)
        if last_user is None:
            yield history
            return
        yield from respond(history[: last_user + 1], system, temperature, top_p, top_k, max_tokens, thinking, image_tokens, tools_json, request)

    def retry(history, system, temperature, top_p, top_k, max_tokens, thinking, image_tokens, tools_json, retry_data: gr.RetryData, request: gr.Request):
        yield from respond(list(history)[: retry_data.index + 1], system, temperature, top_p, top_k, max_tokens, thinking, image_tokens, tools_json, request)

    def edit(history, system, temperature, top_p, top_k, max_tokens, thinking, image_tokens, tools_json, edit_data: gr.EditData, request: gr.Request):
        history = list(history)[: edit_data.index + 1]
        history[edit_data.index] = {"role": "user", "content": edit_data.value}
        yield from respond(history, system, temperature, top_p, top_k, max_tokens, thinking, image_tokens, tools_json, request)

    def undo(history):
        """Remove the last exchange; its text goes back into the input box."""
        history = list(history or [])
        last_user = max((i for i, m in enumerate(history) if m["role"] == "user"), default=None)
        if last_user is None:
            return history, gr.update()
        first = last_user
        while first > 0 and history[first - 1]["role"] == "user":
            first -= 1
        text = "\n".join(message_text(m) for m in history[first : last_user + 1] if message_text(m))
        return history[:first], {"text": text, "files": []}

    def undo_event(history, undo_data: gr.UndoData):
        history = list(history)
        return history[: undo_data.index], {"text": message_text(history[undo_data.index]), "files": []}

    def stop(request: gr.Request):
        """Stop the running reply after the current token."""
        stop_event(request).set()

    def export(history):
        path = Path(exports.name) / f"conversation-{next(export_count)}.md"
        path.write_text(to_markdown(history or [], holder.name), encoding="utf-8")
        return str(path)

    def status():
        caps = holder.capabilities
        media = ", ".join(k for k, v in caps.items() if v) or "text only"
        text = holder.status + (f" · input: text, {media}" if holder.engine is not None else "")
        return text, gr.Timer(active=not holder.ready.is_set())

    with gr.Blocks(title="Gemma 4 on MLX", fill_height=True) as demo:
        saved = gr.BrowserState([], storage_key="gemma4-mlx-chat")
        with gr.Sidebar(open=False):
            gr.Markdown("### Settings")
            system = gr.Textbox("", label="System prompt", lines=3, placeholder="You are a helpful assistant.")
            thinking = gr.Checkbox(label="Thinking (show the model's reasoning)", value=False)
            temperature = gr.Slider(0.0, 2.0, value=1.0, step=0.05, label="Temperature (0 = greedy)")
            top_p = gr.Slider(0.0, 1.0, value=0.95, step=0.01, label="Top-p")
            top_k = gr.Slider(0, 200, value=64, step=1, label="Top-k (0 = off)")
            max_tokens = gr.Slider(1, 8192, value=1024, step=1, label="Max new tokens")
            image_tokens = gr.Dropdown(IMAGE_BUDGETS, value=280, label="Image token budget (more = finer detail, slower)")
            tools = gr.Code("", label="Tools (JSON list of function declarations, optional)", language="json", lines=6)
        settings += [system, temperature, top_p, top_k, max_tokens, thinking, image_tokens, tools]
        gr.Markdown(f"## Gemma 4 · {holder.name}")
        status_line = gr.Markdown(holder.status, elem_id="status")
        chatbot = gr.Chatbot(
            label="Chat", elem_id="chatbot", height="70vh", editable="user", latex_delimiters=LATEX,
            buttons=["copy", "copy_all"], placeholder="Ask anything. Attach images, audio or video, or record from the microphone.",
        )  # fmt: skip
        textbox = gr.MultimodalTextbox(
            placeholder="Message Gemma (Enter to send, Shift+Enter for a new line)", file_count="multiple",
            file_types=["image", "audio", "video"], sources=["upload", "microphone"], show_label=False, elem_id="input",
        )  # fmt: skip
        with gr.Row():
            stop_btn = gr.Button("Stop", size="sm", elem_id="stop")
            regen_btn = gr.Button("Regenerate", size="sm", elem_id="regenerate")
            undo_btn = gr.Button("Undo", size="sm", elem_id="undo")
            clear_btn = gr.Button("Clear", size="sm", elem_id="clear")
            export_btn = gr.DownloadButton("Export Markdown", size="sm", elem_id="export")

        timer = gr.Timer(1.0)
        timer.tick(status, None, [status_line, timer], show_progress="hidden", queue=False, api_visibility="private")
        demo.load(status, None, [status_line, timer], queue=False, api_visibility="private")

        gen = dict(concurrency_id="model", concurrency_limit=1, show_progress="hidden")
        textbox.submit(chat, [textbox, chatbot, *settings], [chatbot, textbox], api_name="chat", **gen)
        regen_btn.click(regenerate, [chatbot, *settings], [chatbot], api_name="regenerate", **gen)
        chatbot.retry(retry, [chatbot, *settings], [chatbot], api_visibility="private", **gen)
        chatbot.edit(edit, [chatbot, *settings], [chatbot], api_visibility="private", **gen)
        stop_btn.click(stop, None, None, api_name="stop", queue=False)
        # Undo and clear stop a running reply and wait in its queue: run beside it, they could be
        # overwritten by the reply's last update, which would bring the removed messages back.
        for trigger in (chatbot.undo, undo_btn.click, clear_btn.click):
            trigger(stop, None, None, queue=False, api_visibility="private")
        undone = chatbot.undo(undo_event, [chatbot], [chatbot, textbox], api_visibility="private", **gen)
        undone_by_button = undo_btn.click(undo, [chatbot], [chatbot, textbox], api_name="undo", **gen)
        cleared = clear_btn.click(lambda: [], None, [chatbot], api_name="clear", **gen)
        export_btn.click(export, [chatbot], [export_btn], api_name="export")

        # Conversations survive page reloads: the history is kept in the browser's local storage.
        # The chatbot reports a change with its empty initial value as the page loads; saving that
        # raced the restore below and could erase the saved conversation. So a change saves only a
        # non-empty history, and the events that can empty the chat (clear, undo) save after them.
        save = dict(queue=False, api_visibility="private")
        chatbot.change(lambda h: h if h else gr.skip(), [chatbot], [saved], **save)
        for emptying in (cleared, undone, undone_by_button):
            emptying.then(lambda h: h, [chatbot], [saved], **save)
        demo.load(lambda h: h, [saved], [chatbot], **save)
    return demo


def _note(text: str, title: str = ERROR_TITLE) -> dict:
    return {"role": "assistant", "content": text, "metadata": {"title": title + text.split("\n")[0][:80]}}


def _reply_messages(reply, done: bool) -> list[dict]:
    """A reply as page messages: reasoning (collapsible, closed once done), answer, tool calls."""
    messages = []
    if reply.thinking:
        messages.append({"role": "assistant", "content": reply.thinking, "metadata": {"title": THINKING_TITLE, "status": "done" if done else "pending"}})
    if reply.content:
        messages.append({"role": "assistant", "content": reply.content})
    for call in reply.tool_calls:
        body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False, indent=2)
        messages.append({"role": "assistant", "content": body, "metadata": {"title": TOOL_TITLE + (call.name or "?")}})
    return messages


def _stats_detail(s, finish: str | None) -> str:
    return (
        f"- time to first token: {s.time_to_first_token:.2f} s\n"
        f"- prompt: {s.prompt_tokens} tokens, {s.reused_tokens} reused from the cache, "
        f"{s.prompt_tokens - s.reused_tokens} prefilled at {s.prompt_tps:.1f} tok/s\n"
        f"- generation: {s.generation_tokens} tokens at {s.generation_tps:.1f} tok/s\n"
        f"- peak memory: {s.peak_memory:.2f} GB\n- finish: {finish}"
    )
