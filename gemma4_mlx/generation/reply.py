"""Splitting a streamed Gemma 4 reply into reasoning, answer and tool calls.

Gemma 4 marks its parts with special tokens: reasoning comes as ``<|channel>thought\\n...<channel|>``,
a tool call as ``<|tool_call>call:NAME{key:value,...}<tool_call|>`` with strings quoted by ``<|"|>``.
The markers are single tokens, so the reply is split by token id (no text matching on partial
output), and each part keeps its own streaming detokenizer state.
No library parses Gemma 4's tool-call syntax (it is not JSON), hence :func:`parse_tool_call`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

THINKING, ANSWER, TOOL_CALL = "thinking", "answer", "tool_call"
_MARKERS = {"<|channel>": ("open", THINKING), "<channel|>": ("close", THINKING),
            "<|tool_call>": ("open", TOOL_CALL), "<tool_call|>": ("close", TOOL_CALL)}  # fmt: skip
QUOTE = '<|"|>'
CHANNEL_NAME = "thought\n"


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str  # the call as the model wrote it, for display when it cannot be parsed


@dataclass
class Reply:
    """A reply so far: reasoning, answer text and completed tool calls."""

    thinking: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def as_message(self) -> dict[str, Any]:
        """The assistant message to keep in the conversation (the template drops reasoning anyway)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content.strip()}
        if self.tool_calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls]
        return message


class ReplySplitter:
    """Feeds tokens of one reply; returns ``(part, new_text)`` for what each token adds."""

    def __init__(self, processor):
        self.processor = processor
        tok = processor.tokenizer
        self.markers: dict[int, tuple[str, str]] = {}
        for text, role in _MARKERS.items():
            i = tok.convert_tokens_to_ids(text)
            if isinstance(i, int) and i != tok.unk_token_id:
                self.markers[i] = role
        # Other special tokens (media placeholders, turn markers, ...) are never shown or kept: written
        # back into the conversation as text they would be read as the tokens themselves.
        hf = getattr(tok, "_tokenizer", tok)
        self.hidden = set(getattr(hf, "all_special_ids", [])) | {
            i for i, t in getattr(hf, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
        }
        self.hidden -= set(self.markers)
        cfg = processor.config
        # Media placeholders and their brackets must never come back into a prompt outside real media.
        self.media_ids = {getattr(cfg, f, None) for f in ("image_token_id", "video_token_id", "audio_token_id",
                          "boi_token_id", "eoi_token_id", "boa_token_id", "eoa_token_id")} - {None}  # fmt: skip
        # The tokens the answer text came from, for the chat engine to reuse as they are when the
        # conversation is rendered again (re-tokenizing the text can give other ids).
        self.answer_ids: list[int] = []
        self.answer_ids_usable = True  # False once the answer holds text that is not from answer_ids
        self.detokenizer = processor.detokenizer
        self.detokenizer.reset()
        self.part = ANSWER
        self.reply = Reply()
        self._call_tokens: list[int] = []
        self._raw_thinking = ""

    def add(self, token: int) -> tuple[str, str]:
        """Add one generated token (not an end token); returns the part it belongs to and its text."""
        marker = self.markers.get(token)
        if marker is None:
            if self.part == ANSWER and token not in self.media_ids:
                self.answer_ids.append(token)
            if token in self.hidden and self.part != TOOL_CALL:
                return self.part, ""
            if self.part == TOOL_CALL:
                self._call_tokens.append(token)
                return TOOL_CALL, ""
            self.detokenizer.add_token(token)
            return self.part, self._take(self.detokenizer.last_segment)
        kind, part = marker
        text = self._flush()
        flushed_part = self.part
        if kind == "open":
            self.part = part
            self._call_tokens = []
        elif self.part == part:  # a close marker of the open part
            if part == TOOL_CALL:
                raw = self.processor.decode(self._call_tokens)
                self.reply.tool_calls.append(parse_tool_call(raw))
            self.part = ANSWER
        return flushed_part, text

    def finish(self) -> tuple[str, str]:
        """Flush held-back text at the end of the reply (an unfinished tool call is kept as text)."""
        part, text = self.part, self._flush()
        if self.part == TOOL_CALL and self._call_tokens:
            raw = self.processor.decode(self._call_tokens)
            self.reply.content += raw
            self.answer_ids_usable = False
            return ANSWER, raw
        return part, text

    def _flush(self) -> str:
        self.detokenizer.finalize()
        text = self._take(self.detokenizer.last_segment)
        self.detokenizer.reset()
        return text

    def _take(self, text: str) -> str:
        if not text:
            return ""
        if self.part == THINKING:
            # The channel's name ("thought\n") opens the reasoning; it is not part of it, so text
            # is held back while it could still be that name.
            self._raw_thinking += text
            raw = self._raw_thinking
            if CHANNEL_NAME.startswith(raw):
                return ""
            shown = raw[len(CHANNEL_NAME):] if raw.startswith(CHANNEL_NAME) else raw
            new = shown[len(self.reply.thinking):]
            self.reply.thinking = shown
            return new
        if self.part == ANSWER:
            self.reply.content += text
        return text


def parse_tool_call(raw: str) -> ToolCall:
    """``call:NAME{key:value,...}`` (Gemma 4's tool-call syntax) -> :class:`ToolCall`.

    Values are ``<|"|>``-quoted strings, numbers, true/false/null, ``[...]`` and ``{...}``; keys are
    bare or quoted. Text that does not parse gives a call with empty arguments and the raw text.
    """
    text = raw.strip()
    m = re.match(r"(?:call:)?([\w.\-]+)\s*(\{.*)?$", text, re.S)
    if not m:
        return ToolCall(name="", arguments={}, raw=raw)
    name, body = m.group(1), m.group(2)
    if body is None:
        return ToolCall(name=name, arguments={}, raw=raw)
    try:
        value, end = _parse_value(body, 0)
        if end != len(body) or not isinstance(value, dict):
            raise ValueError("trailing text")
    except (ValueError, IndexError):
        return ToolCall(name=name, arguments={}, raw=raw)
    return ToolCall(name=name, arguments=value, raw=raw)


def _parse_value(s: str, i: int) -> tuple[Any, int]:
    i = _skip_space(s, i)
    if s.startswith(QUOTE, i):
        end = s.index(QUOTE, i + len(QUOTE))
        return s[i + len(QUOTE) : end], end + len(QUOTE)
    if s[i] == "{":
        out: dict[str, Any] = {}
        i = _skip_space(s, i + 1)
        while s[i] != "}":
            if s.startswith(QUOTE, i):
                key, i = _parse_value(s, i)
            else:
                m = re.compile(r"[^:,{}\[\]\s]+").match(s, i)
                if not m:
                    raise ValueError(f"bad key at {i}")
                key, i = m.group(0), m.end()
            i = _skip_space(s, i)
            if s[i] != ":":
                raise ValueError(f"expected ':' at {i}")
            out[key], i = _parse_value(s, i + 1)
            i = _skip_space(s, i)
            if s[i] == ",":
                i = _skip_space(s, i + 1)
        return out, i + 1
    if s[i] == "[":
        items = []
        i = _skip_space(s, i + 1)
        while s[i] != "]":
            item, i = _parse_value(s, i)
            items.append(item)
            i = _skip_space(s, i)
            if s[i] == ",":
                i = _skip_space(s, i + 1)
        return items, i + 1
    m = re.compile(r"[^,{}\[\]]+").match(s, i)
    if not m:
        raise ValueError(f"bad value at {i}")
    word = m.group(0).strip()
    literals = {"true": True, "false": False, "null": None, "none": None}
    if word.lower() in literals:
        return literals[word.lower()], m.end()
    try:
        return (float(word) if any(c in word for c in ".eE") else int(word)), m.end()
    except ValueError:
        return word, m.end()  # a bare word: keep it as a string


def _skip_space(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i
