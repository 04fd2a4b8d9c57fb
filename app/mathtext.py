"""Inline math in replies without dollar amounts turning into math.

Gradio's Chatbot finds LaTeX with KaTeX's auto-render, which pairs delimiters literally: with ``$``
as a delimiter, "$5 and $10" renders "5 and " as math, and auto-render has no option for the usual
rule. So the page is given ``$$``, ``\\(`` and ``\\[`` only (see ``LATEX`` in app/ui.py), and the
``$...$`` spans of a reply that follow the usual rule (pandoc's: no space after the opening ``$``,
none before the closing one, no digit right after it) are shown as ``\\(...\\)``.

The model must get back exactly the text it generated (the engine reuses its KV cache by matching
it), so :func:`to_display` has an exact inverse, :func:`from_display`. To keep the conversion
reversible, a ``\\(`` the model wrote itself gets a no-op ``\\relax `` after it (invisible in
KaTeX); a bare ``\\(`` in displayed text is always a converted ``$``. Code (fenced blocks and
backtick spans) is never changed. Tests check ``from_display(to_display(t)) == t`` on many strings.
"""

from __future__ import annotations

import re

MARK = "\\relax "  # after a \( the model wrote itself
# Fenced code blocks (to their closing fence or the end) and backtick code spans.
_CODE = re.compile(r"^(`{3,}|~{3,})[^\n]*\n.*?(?:^\1[ \t]*$|\Z)|(`+).*?(?<!`)\2(?!`)", re.S | re.M)


def _segments(text: str):
    """(is_code, piece) pieces of ``text``, in order."""
    pos = 0
    for m in _CODE.finditer(text):
        if m.start() > pos:
            yield False, text[pos : m.start()]
        yield True, m.group(0)
        pos = m.end()
    if pos < len(text):
        yield False, text[pos:]


def _closing_dollar(s: str, start: int) -> int:
    """Index of the ``$`` that closes inline math opened just before ``start``, or -1."""
    i = start
    while i < len(s):
        c = s[i]
        if c == "\n":
            return -1
        if c == "\\":
            i += 2
            continue
        if c == "$":
            ok = not s[i - 1].isspace() and not s[i + 1 : i + 2].isdigit() and s[i + 1 : i + 2] != "$"
            return i if ok and i > start else -1
        i += 1
    return -1


def _convertible(body: str) -> bool:
    return "\\(" not in body and "\\)" not in body and not body.startswith(MARK)


def _prose_to_display(s: str) -> str:
    out = []
    i, n = 0, len(s)
    while i < n:
        if s.startswith("\\(", i):
            out.append("\\(" + MARK)
            i += 2
        elif s[i] == "\\":
            out.append(s[i : i + 2])
            i += 2
        elif s.startswith("$$", i):
            end = s.find("$$", i + 2)
            end = i + 2 if end == -1 else end + 2  # display math stays as it is, unclosed $$ too
            out.append(s[i:end])
            i = end
        elif s[i] == "$" and i + 1 < n and not s[i + 1].isspace():
            close = _closing_dollar(s, i + 1)
            if close != -1 and _convertible(s[i + 1 : close]):
                out.append("\\(" + s[i + 1 : close] + "\\)")
                i = close + 1
            else:
                out.append("$")
                i += 1
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _prose_from_display(s: str) -> str:
    out = []
    i, n = 0, len(s)
    while i < n:
        if s.startswith("\\(", i):
            if s.startswith(MARK, i + 2):  # the model's own \(
                out.append("\\(")
                i += 2 + len(MARK)
            else:  # a converted $...$
                close = s.find("\\)", i + 2)
                out.append("$" + s[i + 2 : close] + "$")
                i = close + 2
        elif s[i] == "\\":
            out.append(s[i : i + 2])
            i += 2
        elif s.startswith("$$", i):
            end = s.find("$$", i + 2)
            end = i + 2 if end == -1 else end + 2
            out.append(s[i:end])
            i = end
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def to_display(text: str) -> str:
    """A reply's text as the page shows it (see the module's docstring)."""
    return "".join(piece if code else _prose_to_display(piece) for code, piece in _segments(text))


def from_display(text: str) -> str:
    """The exact inverse of :func:`to_display`."""
    return "".join(piece if code else _prose_from_display(piece) for code, piece in _segments(text))
