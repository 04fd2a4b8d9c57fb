"""The chat page (Gradio Blocks).

One generator, :func:`_Chat.reply`, serves every turn: it rebuilds the model conversation from the
page's history and streams the reply into it (reasoning and tool calls as their own collapsible
blocks, then a statistics line). Sending, regenerate, retry, edit and undo edit the history and
call the same code; the engine's prefix cache makes that cheap.

The browser keeps the conversations (a list in the sidebar, each with its own settings) in its
local storage through gr.BrowserState; app/store.py holds the store's logic.
"""

from __future__ import annotations

import contextlib

import html
import itertools
import math
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from gemma4_mlx.errors import ContextLengthError
from gemma4_mlx.errors import MediaError

from . import store as convs
from .backend import (
    STATS_TITLE,
    THINKING_TITLE,
    TOOL_TITLE,
    WAIT_NOTE,
    ModelHolder,
    ToolsError,
    calls_label,
    file_names,
    message_text,
    note,
    parse_tools,
    pending_tool_calls,
    to_markdown,
    to_model_messages,
    tool_result_message,
    unsupported_media,
)
from .mathtext import from_display, to_display

IMAGE_BUDGETS = [70, 140, 280, 560, 1120]
KV_CACHE_CHOICES = [("Exact (the model's precision)", "exact"), ("8-bit", "8-bit"), ("4-bit", "4-bit")]
# No single-$ delimiter: KaTeX's auto-render would pair the dollars of "$5 and $10". Replies' $...$
# math that follows the usual rule is shown as \(...\) instead (app/mathtext.py, Chatbot below).
LATEX = [
    {"left": "$$", "right": "$$", "display": True},
    {"left": "\\[", "right": "\\]", "display": True},
    {"left": "\\(", "right": "\\)", "display": False},
]
# Seconds between a reply's updates to the page, and more per character of the reply. The page
# renders the whole reply again on each update: at one update per token a fast model (the demo's
# writes 250 tokens/s) starves the browser, whose Stop button then cannot be pressed.
UPDATE_INTERVAL, UPDATE_INTERVAL_PER_CHAR = 0.05, 1 / 200_000
PLACEHOLDER = "Message Gemma (Enter to send, Shift+Enter for a new line)"
STORAGE_KEY = "gemma4-mlx-conversations"
CSS = """
.app-note { border-left: 4px solid #d93025; background: #fdecea; color: #5f2120; padding: 8px 12px; border-radius: 6px; }
.app-note strong { display: block; margin-bottom: 2px; }
.app-note.app-note-wait { border-left-color: #1a73e8; background: #e8f0fe; color: #174ea6; }
.dark .app-note { background: #3c1f1d; color: #f6c8c3; }
.dark .app-note.app-note-wait { background: #1c2b41; color: #c6dafc; }
#status p, #conversation-settings p { margin: 0; font-size: var(--text-sm); }
#title h2 { margin: 0; font-size: var(--text-xl); }
#conversations .wrap { flex-direction: column; align-items: stretch; }
#conversations label { width: 100%; }
#actions button { min-width: 0; }
"""


class Chatbot(gr.Chatbot):
    """gr.Chatbot whose page shows replies' inline ``$...$`` math as ``\\(...\\)`` (app/mathtext.py).

    Done where values cross to and from the page, so every event, the store and the model see the
    text exactly as the model wrote it. ``is_template`` makes Gradio use gr.Chatbot's frontend."""

    is_template = True

    def postprocess(self, value):
        return super().postprocess(_map_replies(value, to_display))

    def preprocess(self, payload):
        return _map_replies(super().preprocess(payload), from_display)


def _map_replies(history, fn):
    """A copy of ``history`` with ``fn`` applied to the text of assistant messages."""
    if not isinstance(history, list):
        return history
    out = []
    for m in history:
        if isinstance(m, dict) and m.get("role") == "assistant":
            content = m.get("content")
            if isinstance(content, str):
                m = {**m, "content": fn(content)}
            elif isinstance(content, list):
                m = {**m, "content": [{**p, "text": fn(p["text"])} if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) else p for p in content]}
        out.append(m)
    return out


@dataclass
class Page:
    """The page's components."""

    store: gr.BrowserState
    new_chat: gr.Button
    conversations: gr.Radio
    name: gr.Textbox
    delete: gr.Button
    confirm_row: gr.Row
    confirm_delete: gr.Button
    cancel_delete: gr.Button
    settings: list  # in store.SETTING_NAMES order
    status: gr.Markdown
    summary: gr.Markdown
    chatbot: Chatbot
    textbox: gr.MultimodalTextbox
    regenerate: gr.Button
    undo: gr.Button
    clear: gr.Button
    export: gr.DownloadButton
    api_button: gr.Button
    api_stop: gr.Button
    api_export: gr.Button


class Replies:
    """Per browser session: the stop flag of its reply and whether one is running.

    A Stop pressed after the page asked for a reply but before it began (it waits in the model's
    queue, behind another tab's or an API client's reply) stops that reply as it begins; a Stop
    from before the request does not. Undo and Clear pressed during (or before) a reply replace
    the conversation that the reply would save."""

    def __init__(self):
        self._stops: dict[str, threading.Event] = {}
        self._busy: set[str] = set()
        # When things happened, as a count of events (exact order, unlike a clock's ties)
        self._events = itertools.count()
        self._asked: dict[str, int] = {}  # when the page asked for the reply that has not begun
        self._stopped: dict[str, int] = {}  # when Stop was last pressed
        self._began: dict[str, int] = {}  # when the last reply was asked for (or began: the API's)
        self._replaced: dict[str, int] = {}  # when Undo or Clear was last pressed

    @staticmethod
    def key(request: gr.Request | None) -> str:
        return request.session_hash if request is not None and request.session_hash else "default"

    def stop_event(self, request) -> threading.Event:
        return self._stops.setdefault(self.key(request), threading.Event())

    def busy(self, request) -> bool:
        return self.key(request) in self._busy

    def asked(self, request) -> None:
        """The page asked for a reply (it begins when the model's queue comes to it)."""
        self._asked[self.key(request)] = next(self._events)

    def begin(self, request) -> threading.Event:
        """A reply begins: its stop flag, already set if Stop was pressed since the page asked for it."""
        key = self.key(request)
        asked = self._asked.pop(key, None)
        self._began[key] = asked if asked is not None else next(self._events)
        stop = self.stop_event(request)
        if self._stopped.get(key, -math.inf) < self._began[key]:
            stop.clear()
        self._busy.add(key)
        return stop

    def ended(self, request) -> None:
        self._busy.discard(self.key(request))

    def stop(self, request) -> None:
        self._stopped[self.key(request)] = next(self._events)
        self.stop_event(request).set()

    def replace(self, request) -> None:
        """Undo or Clear was pressed: the running reply stops, and its conversation is not saved."""
        self._replaced[self.key(request)] = next(self._events)
        self.stop(request)

    def replaced_since_reply(self, request) -> bool:
        key = self.key(request)
        return self._replaced.get(key, -math.inf) > self._began.get(key, math.inf)

    def stop_all(self) -> None:
        """Stop every running reply (the app is exiting)."""
        for event in list(self._stops.values()):
            event.set()


def build_app(holder: ModelHolder) -> gr.Blocks:
    """The Blocks app for a model that ``holder`` loads in the background. Launch it with
    :func:`launch` (it passes the page's CSS); ``app.replies.stop_all()`` stops running replies."""
    with gr.Blocks(title="Gemma 4 on MLX", fill_height=True) as demo:
        page = _layout(holder)
        replies = Replies()
        finish = _Finish(holder, page, replies, convs.Sessions())
        chat = _Chat(holder, replies, page, finish)
        chat.wire()
        _wire_store(page, chat, finish)
    demo.replies = chat.replies
    return demo


def launch(app: gr.Blocks, api=None, **kwargs):
    """``app.queue().launch(**kwargs)`` with the page's CSS; ``api`` (a FastAPI router, the
    OpenAI-compatible API of :mod:`app.api`) is served beside the page by the same server."""
    app_kwargs = {}
    if api is not None:

        @contextlib.asynccontextmanager
        async def with_api(server):  # Gradio's FastAPI app, as it starts
            server.include_router(api)
            yield

        app_kwargs["lifespan"] = with_api
    return app.queue().launch(css=CSS, app_kwargs=app_kwargs, **kwargs)


def _layout(holder: ModelHolder) -> Page:
    defaults = convs.SETTINGS_DEFAULTS
    secret = convs.browser_secret()
    store = gr.BrowserState(convs.normalize(None), storage_key=STORAGE_KEY, secret=secret)
    with gr.Sidebar(open=False, label="Conversations"):
        new_chat = gr.Button("New chat", variant="primary", size="sm", elem_id="new-chat")
        conversations = gr.Radio([], label="Conversations", elem_id="conversations")
        name = gr.Textbox(label="Name of this conversation", max_lines=1, elem_id="conversation-name",
                          placeholder="Named after its first message; Enter to rename")  # fmt: skip
        delete = gr.Button("Delete this conversation", size="sm", variant="secondary", elem_id="delete")
        with gr.Row(visible=False) as confirm_row:
            confirm_delete = gr.Button("Delete", size="sm", variant="stop", elem_id="confirm-delete")
            cancel_delete = gr.Button("Keep", size="sm", elem_id="cancel-delete")
        with gr.Accordion("Settings of this conversation", open=False, elem_id="settings"):
            system = gr.Textbox(defaults["system"], label="System prompt", lines=3, placeholder="You are a helpful assistant.", elem_id="system")
            thinking = gr.Checkbox(label="Thinking (show the model's reasoning)", value=defaults["thinking"], elem_id="thinking")
            temperature = gr.Slider(0.0, 2.0, value=defaults["temperature"], step=0.05, label="Temperature (0 = greedy)")
            top_p = gr.Slider(0.01, 1.0, value=defaults["top_p"], step=0.01, label="Top-p (1 = off)")
            top_k = gr.Slider(0, 200, value=defaults["top_k"], step=1, label="Top-k (0 = off)")
            max_tokens = gr.Slider(1, 8192, value=defaults["max_tokens"], step=1, label="Max new tokens")
            image_tokens = gr.Dropdown(IMAGE_BUDGETS, value=defaults["image_tokens"], label="Image token budget (more = finer detail, slower)")
            tools = gr.Code(defaults["tools"], label="Tools: function declarations (JSON: one, or a list)", language="json", lines=6, elem_id="tools")
            speculative = gr.Checkbox(label="Speculative decoding with the drafter (the same replies, faster; when one is loaded)",
                                      value=defaults["speculative"], elem_id="speculative")  # fmt: skip
            kv_cache = gr.Dropdown(KV_CACHE_CHOICES, value=defaults["kv_cache"], elem_id="kv-cache",
                                   label="KV cache (8-bit: long conversations in half the memory; 4-bit: a quarter, less exact)")  # fmt: skip
    by_name = {"system": system, "thinking": thinking, "temperature": temperature, "top_p": top_p, "top_k": top_k,
               "max_tokens": max_tokens, "image_tokens": image_tokens, "tools": tools, "speculative": speculative,
               "kv_cache": kv_cache}  # fmt: skip
    gr.Markdown(f"## Gemma 4 · {holder.name}", elem_id="title")
    # Not the model's status now (a page opened later would show this value first): the page's load
    # event shows the status once the conversation is restored.
    status = gr.Markdown("Opening…", elem_id="status")
    summary = gr.Markdown(_summary(dict(defaults)), elem_id="conversation-settings")
    chatbot = Chatbot(
        label="Chat", elem_id="chatbot", scale=1, min_height=160, editable="user", latex_delimiters=LATEX,
        buttons=["copy", "copy_all"], placeholder="Ask anything. Attach images, audio or video, or record from the microphone.",
    )  # fmt: skip
    textbox = gr.MultimodalTextbox(
        placeholder=PLACEHOLDER, file_count="multiple", file_types=["image", "audio", "video"], sources=["upload", "microphone"],
        show_label=False, elem_id="input", submit_btn=True, stop_btn=False, interactive=False,  # until restored
    )  # fmt: skip
    with gr.Row(elem_id="actions"):
        regenerate = gr.Button("Regenerate", size="sm", elem_id="regenerate", min_width=60)
        undo = gr.Button("Undo", size="sm", elem_id="undo", min_width=60)
        clear = gr.Button("Clear", size="sm", elem_id="clear", min_width=60)
        export = gr.DownloadButton("Export", size="sm", elem_id="export", min_width=60)
    # Hidden: they carry API endpoints whose page counterparts work differently (the page sends in
    # steps, stops from the send button and exports on every change).
    api_button, api_stop, api_export = (gr.Button(visible=False) for _ in range(3))
    return Page(store, new_chat, conversations, name, delete, confirm_row, confirm_delete, cancel_delete,
                [by_name[n] for n in convs.SETTING_NAMES], status, summary, chatbot, textbox, regenerate, undo, clear, export,
                api_button, api_stop, api_export)  # fmt: skip


def _summary(settings: dict) -> str:
    """The line above the chat that says how this conversation is set up."""
    system = " ".join(settings["system"].split())
    system = f"“{html.escape(system[:80])}{'…' if len(system) > 80 else ''}”" if system else "none"
    parts = [f"System prompt: {system}", f"Thinking: {'on' if settings['thinking'] else 'off'}"]
    try:
        tools = parse_tools(settings["tools"])
    except ToolsError:
        parts.append("Tools: not valid (see Settings)")
    else:
        if tools:
            parts.append("Tools: " + ", ".join(html.escape(t["function"]["name"]) for t in tools))
    return " · ".join(parts)


def _settings(values) -> dict:
    return dict(zip(convs.SETTING_NAMES, values))


# ---------------------------------------------------------------------------- chat events
class _Chat:
    """The chat's events: send, reply, stop, regenerate, retry, edit, undo, clear."""

    def __init__(self, holder: ModelHolder, replies: Replies, page: Page, finish: "_Finish"):
        self.holder, self.replies, self.page, self.finish = holder, replies, page, finish

    def reply(self, history: list, values: list, request) -> "iter":
        """Stream the reply to ``history`` (which ends with the user's turn) as updated histories."""
        holder = self.holder
        history = list(history or [])
        if not history or history[-1].get("role") != "user":
            yield history  # nothing to answer
            return
        settings = _settings(values)
        if not holder.ready.is_set():
            yield history + [note("Waiting for the model to load… (progress at the top of the page)", "Please wait", WAIT_NOTE)]
            holder.ready.wait()
        if holder.engine is None:
            yield history + [note(holder.status, "The model is not loaded")]
            return
        try:
            tools = parse_tools(settings["tools"])
        except ToolsError as e:
            yield history + [note(str(e) + " Fix it under Settings, then send again or press Regenerate.", "The tools setting cannot be used")]
            return
        messages = to_model_messages(history, settings["system"])
        problem = unsupported_media(messages, holder.capabilities)
        if problem:
            yield history + [note(problem, "This file cannot be used")]
            return
        stop = self.replies.begin(request)
        reply_start = len(history)
        chunk = None
        try:
            stream = holder.engine.stream(
                messages, max_tokens=int(settings["max_tokens"]), temperature=float(settings["temperature"]),
                top_p=float(settings["top_p"]), top_k=int(settings["top_k"]), enable_thinking=bool(settings["thinking"]),
                tools=tools, max_soft_tokens=int(settings["image_tokens"]), stop_event=stop,
                speculative=bool(settings["speculative"]), kv_bits=convs.KV_CACHE_BITS.get(settings["kv_cache"]),
                kv_group_size=holder.kv_group_size,
            )  # fmt: skip
            shown = 0.0
            for chunk in stream:
                length = len(chunk.reply.content or "") + len(chunk.reply.thinking or "")
                if chunk.finish_reason is None and time.monotonic() - shown < UPDATE_INTERVAL + length * UPDATE_INTERVAL_PER_CHAR:
                    continue  # shown with a later token
                history[reply_start:] = _reply_messages(chunk.reply, done=chunk.finish_reason is not None)
                yield history
                shown = time.monotonic()
        except (MediaError, ContextLengthError, ValueError, OSError, RuntimeError) as e:
            del history[reply_start:]
            yield history + [note(file_names(history, str(e)), "Could not reply")]
            return
        finally:
            self.replies.ended(request)
        if chunk is not None:
            history[reply_start:] = _reply_messages(chunk.reply, done=True)  # the last tokens, if not yet shown
            s = chunk.stats
            calls = calls_label([c.name for c in chunk.reply.tool_calls])
            why = {
                "length": " · stopped at max tokens",
                "stopped": " · stopped",
                "tool_call": f" · waiting for the result of {calls}: your next message is sent as the tool's result",
            }
            title = STATS_TITLE + s.summary() + why.get(chunk.finish_reason, "")
            history.append({"role": "assistant", "content": _stats_detail(s, chunk.finish_reason), "metadata": {"title": title, "status": "done"}})
        yield history

    # -- steps of the page's events
    def add_message(self, request: gr.Request, message, history):
        """The user's message (text and files) joins the history; the send button becomes Stop.
        After a tool call, the text is sent as the tool's result."""
        if self.replies.busy(request):
            raise gr.Error("A reply is still being written: wait for it, or press Stop.", print_exception=False)
        history, problem = with_user_message(history, message)
        if problem:
            raise gr.Error(problem, print_exception=False)
        if history is None:
            raise gr.Error("Type a message or attach a file first.", print_exception=False)
        self.replies.asked(request)
        return history, gr.MultimodalTextbox(value=None, submit_btn=False, stop_btn=True, placeholder=PLACEHOLDER)

    def streaming(self, request: gr.Request):
        """The send button shows Stop while a reply streams (regenerate, retry, edit)."""
        self.replies.asked(request)
        return gr.MultimodalTextbox(submit_btn=False, stop_btn=True)

    # Gradio passes its special arguments (gr.Request, gr.RetryData, ...) only to positional
    # parameters, hence these come first, before the settings (*values).
    def stream(self, request: gr.Request, history, *values):
        yield from self.reply(history, list(values), request)

    def regenerate(self, request: gr.Request, history, *values):
        """Drop everything after the last user message and reply again."""
        history = list(history or [])
        last_user = max((i for i, m in enumerate(history) if m["role"] == "user"), default=None)
        if last_user is None:
            yield history
            return
        yield from self.reply(history[: last_user + 1], list(values), request)

    def retry(self, request: gr.Request, retry_data: gr.RetryData, history, *values):
        yield from self.reply(list(history)[: retry_data.index + 1], list(values), request)

    def edit(self, request: gr.Request, edit_data: gr.EditData, history, *values):
        history = list(history)[: edit_data.index + 1]
        history[edit_data.index] = {**history[edit_data.index], "content": edit_data.value}
        yield from self.reply(history, list(values), request)

    def chat_api(self, request: gr.Request, message, history, *values):
        """/chat: add the message and stream the reply, in one call (for gradio_client)."""
        history, problem = with_user_message(history, message)
        if problem:
            raise gr.Error(problem, print_exception=False)
        if history is None:
            yield [], gr.update()
            return
        yield history, gr.update(value=None)
        for h in self.reply(history, list(values), request):
            yield h, gr.update()

    @staticmethod
    def undo(history):
        """Remove the last exchange; its text goes back into the input box."""
        history = list(history or [])
        last_user = max((i for i, m in enumerate(history) if m["role"] == "user"), default=None)
        if last_user is None:
            return history, gr.update()
        first = last_user
        while first > 0 and history[first - 1]["role"] == "user" and not pending_tool_calls(history[: first]):
            first -= 1
        text = "\n".join(message_text(m) for m in history[first : last_user + 1] if message_text(m))
        return history[:first], {"text": text, "files": []}

    @staticmethod
    def undo_event(history, undo_data: gr.UndoData):
        history = list(history)
        return history[: undo_data.index], {"text": message_text(history[undo_data.index]), "files": []}

    def stop(self, request: gr.Request):
        """Stop the running reply after the current token."""
        self.replies.stop(request)

    def replace(self, request: gr.Request):
        """Undo or Clear: stop the running reply, whose conversation they replace."""
        self.replies.replace(request)

    def wire(self) -> None:
        p = self.page
        # No progress overlays: one over the input box would cover its Stop button during a reply.
        private = dict(api_visibility="private")
        quick = dict(queue=False, show_progress="hidden", **private)
        gen = dict(concurrency_id="model", concurrency_limit=1, show_progress="hidden")
        inputs = [p.chatbot, *p.settings]
        finish = self.finish
        # For gradio_client: /chat (message and reply in one call), /stop and /export. First: the
        # page's private events would otherwise take these names (their functions' names).
        p.api_button.click(self.chat_api, [p.textbox, *inputs], [p.chatbot, p.textbox], api_name="chat", **gen)
        p.api_stop.click(self.stop, None, None, api_name="stop", queue=False)
        p.api_export.click(finish.export_file, [p.chatbot], [p.export], api_name="export", queue=False)

        sent = p.textbox.submit(self.add_message, [p.textbox, p.chatbot], [p.chatbot, p.textbox], **quick)
        sent = sent.success(finish.save, finish.inputs, finish.save_outputs, **quick)
        finish.after(sent.success(self.stream, inputs, [p.chatbot], **gen, **private))
        p.textbox.stop(self.stop, None, None, **quick)

        for trigger, fn, name in ((p.regenerate.click, self.regenerate, "regenerate"), (p.chatbot.retry, self.retry, None), (p.chatbot.edit, self.edit, None)):
            # Two listeners, not a chain: only the trigger's own listeners get its data (RetryData, EditData).
            trigger(self.streaming, None, [p.textbox], **quick)
            api = dict(api_name=name) if name else private
            finish.after(trigger(fn, inputs, [p.chatbot], **gen, **api))

        # Undo and clear stop a running reply and wait in its queue: run beside it, they could be
        # overwritten by the reply's last update, which would bring the removed messages back. The
        # reply's save is skipped: it could land after theirs (the page sends both at once).
        for trigger in (p.chatbot.undo, p.undo.click, p.clear.click):
            trigger(self.replace, None, None, **quick)
        finish.after(p.chatbot.undo(self.undo_event, [p.chatbot], [p.chatbot, p.textbox], **gen, **private), reply=False)
        finish.after(p.undo.click(self.undo, [p.chatbot], [p.chatbot, p.textbox], api_name="undo", **gen), reply=False)
        finish.after(p.clear.click(lambda: [], None, [p.chatbot], api_name="clear", **gen), reply=False)

        # Ticks while the model loads. The page's load event restores the conversation first and
        # then shows the status (see _wire_store): "Ready" means the page can be used.
        self.timer = gr.Timer(1.0, active=False)
        self.timer.tick(self.status, None, [p.status, self.timer], **quick)

    def status(self):
        holder = self.holder
        caps = holder.capabilities
        media = ", ".join(k for k, v in caps.items() if v) or "text only"
        if holder.ready.is_set() and holder.engine is None:
            lines = holder.status.split("\n")
            text = note("\n".join(lines[1:]) if len(lines) > 1 else "", lines[0])["content"]
        else:
            text = holder.status + (f" · input: text, {media}" if holder.engine is not None else "")
        return text, gr.Timer(active=not holder.ready.is_set())


def with_user_message(history, message) -> tuple[list | None, str | None]:
    """(history with the user's message added, None), (None, None) for an empty message, or
    (None, problem). Files become messages of their own (as the Chatbot shows them); after a tool
    call, the text is the tool's result."""
    message = message or {}
    text = (message.get("text") or "") if isinstance(message, dict) else str(message)
    files = message.get("files", []) if isinstance(message, dict) else []
    if not text.strip() and not files:
        return None, None
    history = list(history or [])
    calls = pending_tool_calls(history)
    if calls:
        if files:
            return None, f"The last reply is waiting for the result of {calls_label(calls)}: send the result as text, then attach files to your next message."
        return history + [tool_result_message(text.strip(), calls)], None
    for f in files:
        path = f if isinstance(f, str) else f.get("path")
        history.append({"role": "user", "content": {"path": path}})
    if text.strip():
        history.append({"role": "user", "content": text.strip()})
    return history, None


class _Finish:
    """What follows every change of the conversation: save it, restore the send button, refresh
    the conversation list and the export file."""

    def __init__(self, holder: ModelHolder, page: Page, replies: Replies, sessions: convs.Sessions):
        self.holder, self.page, self.replies, self.sessions = holder, page, replies, sessions
        self.exports = tempfile.TemporaryDirectory(prefix="gemma4-chat-")  # removed at exit
        p = page
        self.inputs = [p.store, p.chatbot, *p.settings]
        self.save_outputs = [p.store, p.conversations]

    def change(self, request: gr.Request | None, store, edit) -> tuple[dict, bool]:
        """The session's newest store after ``edit(store, shown)`` (see :class:`app.store.Sessions`)."""
        return self.sessions.change(Replies.key(request), store, edit)

    def save(self, request: gr.Request, store, history, *values):
        settings = _settings(values)
        store, _ = self.change(request, store, lambda s, shown: convs.save(s, history, settings, shown))
        return store, _conversation_list(store)

    def done(self, request: gr.Request, store, history, *values):
        store, radio = self.save(request, store, history, *values)
        return store, radio, _input_box(history), self.export_file(history)

    def done_after_reply(self, request: gr.Request, store, history, *values):
        if self.replies.replaced_since_reply(request):
            return (gr.update(),) * 4  # Undo or Clear pressed: theirs is the conversation to save
        return self.done(request, store, history, *values)

    def after(self, event, reply: bool = True) -> None:
        """Save the conversation, and so on, after ``event`` (a reply, unless ``reply`` is False)."""
        p = self.page
        event.then(self.done_after_reply if reply else self.done, self.inputs, [p.store, p.conversations, p.textbox, p.export],
                   queue=False, show_progress="hidden", api_visibility="private")  # fmt: skip

    def export_file(self, history) -> str:
        """The conversation as a Markdown file named after its first message (for the Export button)."""
        name = _file_name(_first_user_text(history or [])) or "conversation"
        folder = Path(tempfile.mkdtemp(dir=self.exports.name))
        path = folder / f"{name}.md"
        path.write_text(to_markdown(history or [], self.holder.name), encoding="utf-8")
        return str(path)


def _conversation_list(store) -> gr.Radio:
    return gr.Radio(choices=convs.choices(store), value=store["active"])


def _input_box(history) -> gr.MultimodalTextbox:
    """The input box in send mode; after a tool call it says that the next message is its result."""
    calls = pending_tool_calls(history or [])
    placeholder = f"Type the result of {calls_label(calls)} (JSON or text): it is sent to the model as the tool's result" if calls else PLACEHOLDER
    return gr.MultimodalTextbox(submit_btn=True, stop_btn=False, placeholder=placeholder, interactive=True)


def _first_user_text(history: list) -> str:
    return next((message_text(m) for m in history if m.get("role") == "user" and message_text(m).strip()), "")


def _file_name(text: str) -> str:
    words = re.sub(r"[^\w\- ]+", "", " ".join(text.split()[:6]), flags=re.UNICODE).strip()
    return words[:60]


# ---------------------------------------------------------------------------- conversation store
def _wire_store(page: Page, chat: _Chat, finish: _Finish) -> None:
    """The conversation list: restore on load, new, switch, rename, delete; settings saved as changed."""
    p = page
    private = dict(queue=False, show_progress="hidden", api_visibility="private")
    shown = [p.store, p.chatbot, p.conversations, p.name, *p.settings, p.summary, p.textbox, p.export]

    def show(store):
        """Everything the page shows of the active conversation."""
        conv = convs.active(store)
        settings = conv["settings"]
        return (store, conv["history"], _conversation_list(store), conv["title"],
                *[settings[n] for n in convs.SETTING_NAMES], _summary(settings), _input_box(conv["history"]),
                finish.export_file(conv["history"]))  # fmt: skip

    def guard(request: gr.Request):
        if chat.replies.busy(request):
            raise gr.Error("Wait for the reply to finish (or press Stop) before changing conversations.", print_exception=False)

    def restore(store):
        return show(convs.normalize(store))

    # Each change goes through finish.change: to the conversation the page showed, on the session's
    # newest store (events fired together, as a blur and a click, would otherwise undo each other).
    def new_chat(request: gr.Request, store, history, *values):
        guard(request)
        settings = _settings(values)
        store, _ = finish.change(request, store, lambda s, shown: convs.start_new(convs.save(s, history, settings, shown), settings))
        return show(store)

    def switch(request: gr.Request, store, history, conversation_id, *values):
        guard(request)
        settings = _settings(values)
        store, _ = finish.change(request, store, lambda s, shown: convs.switch(convs.save(s, history, settings, shown), conversation_id))
        return show(store)

    def rename(request: gr.Request, store, name):
        store, changed = finish.change(request, store, lambda s, shown: convs.rename(s, name, shown))
        # Unchanged (the box lost focus): no answer that could land after another event's.
        return (store, _conversation_list(store)) if changed else (gr.update(), gr.update())

    def delete(request: gr.Request, store):
        guard(request)
        store, _ = finish.change(request, store, lambda s, shown: convs.delete(s, shown))
        return show(store) + (gr.Row(visible=False),)

    def save_settings(request: gr.Request, store, *values):
        # The settings only: the messages are saved by the events that change them, and a setting's
        # blur during a reply would otherwise save a reply half written.
        settings = _settings(values)
        store, changed = finish.change(request, store, lambda s, shown: convs.save(s, None, settings, shown))
        return (store if changed else gr.update()), _summary(settings)

    demo = gr.context.get_blocks_context().root_block  # the Blocks being built
    # The conversation is restored before the status says the page is ready, and the input box is
    # usable only from then: a message sent earlier would be replaced by the restored conversation.
    demo.load(restore, [p.store], shown, **private).then(chat.status, None, [p.status, chat.timer], **private)
    p.new_chat.click(new_chat, [p.store, p.chatbot, *p.settings], shown, **private)
    p.conversations.input(switch, [p.store, p.chatbot, p.conversations, *p.settings], shown, **private)
    gr.on([p.name.submit, p.name.blur], rename, [p.store, p.name], [p.store, p.conversations], **private)
    p.delete.click(lambda: gr.Row(visible=True), None, [p.confirm_row], **private)
    p.cancel_delete.click(lambda: gr.Row(visible=False), None, [p.confirm_row], **private)
    p.confirm_delete.click(delete, [p.store], [*shown, p.confirm_row], **private)
    # Settings are saved with the conversation when they change (text when it loses focus).
    triggers = []
    for component in p.settings:
        if isinstance(component, (gr.Textbox, gr.Code)):
            triggers.append(component.blur)
        elif isinstance(component, gr.Slider):
            triggers.append(component.release)
        else:
            triggers.append(component.input)
    gr.on(triggers, save_settings, [p.store, *p.settings], [p.store, p.summary], **private)

    def forget(request: gr.Request):
        finish.sessions.forget(Replies.key(request))

    demo.unload(forget)  # the page was closed or reloaded


def _reply_messages(reply, done: bool) -> list[dict]:
    """A reply as page messages: reasoning (collapsible, closed once done), answer, tool calls."""
    import json

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
