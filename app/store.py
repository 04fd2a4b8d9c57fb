"""The conversations a browser keeps (in gr.BrowserState, i.e. the page's local storage).

The store is one JSON value: ``{"active": id, "revision": n, "conversations": [conversation, ...]}``
(most recently used first; the revision counts changes, see :class:`Sessions`); a conversation is
``{"id", "title", "history", "settings"}`` (an empty title means "named after its first message"). The functions here take a store as it comes back from a browser
(any JSON, possibly from an older version of the app) and never fail on it.

BrowserState encrypts what it stores with a secret that is random for each launch unless given, so
a restarted server could no longer read what browsers kept: :func:`browser_secret` keeps one secret
per user on disk.
"""

from __future__ import annotations

import os
import secrets
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import backend
from .backend import message_parts, message_text

# In the order the page's settings are passed to its events (and to the /chat API).
SETTINGS_DEFAULTS: dict[str, Any] = {
    "system": "",
    "temperature": 1.0,
    "top_p": 0.95,
    "top_k": 64,
    "max_tokens": 1024,
    "thinking": False,
    "image_tokens": 280,
    "tools": "",
    "speculative": True,
    "kv_cache": "exact",
}
SETTING_NAMES = list(SETTINGS_DEFAULTS)
# Settings that take one of a few values, and what they mean for the engine.
KV_CACHE_BITS = {"exact": None, "8-bit": 8, "4-bit": 4}
SETTING_CHOICES = {"kv_cache": tuple(KV_CACHE_BITS)}
TITLE_LENGTH = 40


def browser_secret(folder: Path | None = None) -> str:
    """This user's secret for the page's stored conversations, created once (0600, atomically)."""
    folder = Path(folder or backend.CACHE_DIR)
    path = folder / "browser-secret"
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    # Written under a temporary name and linked into place: a reader never sees a partial file, and
    # of two apps starting at once, the second to link keeps (and uses) the first one's secret.
    tmp = folder / f".browser-secret.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return _read_secret(path)


def _read_secret(path: Path) -> str:
    secret = path.read_text().strip()
    if len(secret) < 16:
        raise FileNotFoundError(path)  # empty or truncated: made again
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)
    return secret


# ---------------------------------------------------------------------------- conversations
def new_conversation(settings: dict | None = None) -> dict:
    return {"id": uuid.uuid4().hex[:12], "title": "", "history": [], "settings": clean_settings(settings)}


def clean_settings(settings: Any) -> dict:
    """Known settings with values of the right type; the defaults for anything else."""
    out = dict(SETTINGS_DEFAULTS)
    if not isinstance(settings, dict):
        return out
    for name, default in SETTINGS_DEFAULTS.items():
        value = settings.get(name)
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, (int, float)):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, str) and value in SETTING_CHOICES.get(name, (value,))
        if ok:
            out[name] = type(default)(value) if not isinstance(default, bool) else value
    return out


def normalize(store: Any) -> dict:
    """A valid store from whatever the browser sent (at least one conversation, a valid active id)."""
    conversations = []
    seen = set()
    raw = store.get("conversations") if isinstance(store, dict) else None
    for c in raw if isinstance(raw, list) else []:
        if not isinstance(c, dict) or not isinstance(c.get("id"), str) or c["id"] in seen:
            continue
        history = c.get("history")
        history = [m for m in history if isinstance(m, dict) and m.get("role") in ("user", "assistant")] if isinstance(history, list) else []
        title = c.get("title") if isinstance(c.get("title"), str) else ""
        conversations.append({"id": c["id"], "title": title, "history": history, "settings": clean_settings(c.get("settings"))})
        seen.add(c["id"])
    if not conversations:
        conversations.append(new_conversation())
    active = store.get("active") if isinstance(store, dict) else None
    if active not in seen:
        active = conversations[0]["id"]
    revision = store.get("revision") if isinstance(store, dict) else None
    revision = revision if isinstance(revision, int) and not isinstance(revision, bool) and revision >= 0 else 0
    return {"active": active, "revision": revision, "conversations": conversations}


def active(store: dict) -> dict:
    return find(store, store["active"])


def find(store: dict, conversation_id: str | None) -> dict | None:
    """The conversation with this id (None if there is none)."""
    return next((c for c in store["conversations"] if c["id"] == conversation_id), None)


def title(conversation: dict) -> str:
    """The conversation's name: its own, else its first message (shortened), else "New chat"."""
    if conversation.get("title", "").strip():
        return conversation["title"].strip()
    for message in conversation.get("history", []):
        if message.get("role") != "user":
            continue
        text = " ".join(message_text(message).split())
        if text:
            return text if len(text) <= TITLE_LENGTH else text[:TITLE_LENGTH].rstrip() + "…"
        if any(p["type"] == "file" for p in message_parts(message.get("content"))):
            return "📎 " + _file_name(message)
    return "New chat"


def _file_name(message: dict) -> str:
    for p in message_parts(message.get("content")):
        if p["type"] == "file":
            f = p["file"]
            return f.get("orig_name") or Path(f.get("path") or "").name or "file"
    return "file"


def choices(store: dict) -> list[tuple[str, str]]:
    """(label, id) for the conversation list; labels are made unique (the list shows labels)."""
    out, used = [], {}
    for c in store["conversations"]:
        label = title(c)
        used[label] = used.get(label, 0) + 1
        out.append((label if used[label] == 1 else f"{label} ({used[label]})", c["id"]))
    return out


def save(store: Any, history: list | None, settings: dict, conversation_id: str | None = None) -> dict:
    """The store with a conversation's (by default the active one's) history and settings replaced
    (``history`` None keeps it), and the conversation moved to the top of the list when its history
    changed: the list is most recently used first. A conversation no longer there (deleted) is not
    saved again."""
    store = normalize(store)
    conv = find(store, conversation_id or store["active"])
    if conv is None:
        return store
    history = conv["history"] if history is None else list(history)
    changed = conv["history"] != history
    conv["history"] = history
    conv["settings"] = clean_settings(settings)
    if changed:
        store["conversations"].remove(conv)
        store["conversations"].insert(0, conv)
    return store


def start_new(store: Any, settings: dict) -> dict:
    """A new, empty conversation (with ``settings``) becomes active; empty ones are not kept twice."""
    store = normalize(store)
    store["conversations"] = [c for c in store["conversations"] if c["history"] or c["title"]]
    conv = new_conversation(settings)
    store["conversations"].insert(0, conv)
    store["active"] = conv["id"]
    return store


def switch(store: Any, conversation_id: str) -> dict:
    store = normalize(store)
    if any(c["id"] == conversation_id for c in store["conversations"]):
        # An empty conversation left behind is dropped (it would clutter the list).
        store["conversations"] = [c for c in store["conversations"] if c["history"] or c["title"] or c["id"] == conversation_id]
        store["active"] = conversation_id
    return store


def rename(store: Any, name: str, conversation_id: str | None = None) -> dict:
    """Name a conversation (by default the active one); an empty name means its first message."""
    store = normalize(store)
    conv = find(store, conversation_id or store["active"])
    if conv is not None:
        conv["title"] = " ".join((name or "").split())[:200]
    return store


def delete(store: Any, conversation_id: str | None = None) -> dict:
    """Remove a conversation (by default the active one); if it was the active one, the next one
    (or a new, empty one) becomes active."""
    store = normalize(store)
    conv = find(store, conversation_id or store["active"])
    if conv is None:
        return store
    store["conversations"].remove(conv)
    if not store["conversations"]:
        store["conversations"].append(new_conversation(conv["settings"]))
    if store["active"] == conv["id"]:
        store["active"] = store["conversations"][0]["id"]
    return store


# ---------------------------------------------------------------------------- sessions
class Sessions:
    """Each browser session's newest store, kept by the server as well as by the page.

    The page sends the store it holds with each event, and two events can fire at once: clicking
    New chat while the name box has focus sends the box's blur (a rename) and the click, and a
    setting's blur comes with a click on another conversation. Each would change the store it was
    sent, and the answer that reached the page last would win: the other change undone, or one
    conversation's messages saved into another. So a session's changes run one at a time, each on
    the newest store (the page's when it is newer: after a server restart), and each to the
    conversation that the page showed when the event fired.
    """

    def __init__(self):
        self._lock = threading.Lock()  # one for all sessions: a change takes microseconds
        self._newest: dict[str, dict] = {}

    def change(self, session: str, sent: Any, edit: Callable[[dict, str], dict]) -> tuple[dict, bool]:
        """(newest store, whether it changed) after ``edit(store, shown)``, one of this module's
        functions (they return a new store), where ``shown`` is the id of the conversation that the
        page showed when it sent ``sent``."""
        sent = normalize(sent)
        with self._lock:
            newest = self._newest.get(session)
            base = sent if newest is None or sent["revision"] > newest["revision"] else newest
            store = edit(base, sent["active"])
            if {**store, "revision": 0} == {**base, "revision": 0}:
                return base, False
            store["revision"] = base["revision"] + 1
            self._newest[session] = store
            return store, True

    def forget(self, session: str) -> None:
        """The session ended (its page was closed or reloaded)."""
        with self._lock:
            self._newest.pop(session, None)
