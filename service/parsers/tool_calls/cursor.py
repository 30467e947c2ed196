"""Resumable parsing over a growing text: the cursor and the primitives every syntax uses.

A parser is a generator over a Source: it reads source.text from source.pos on, and where
the text seen so far does not settle what comes next it yields, to be resumed with more text
appended (source.final says no more will come). It returns its result, or raises NoMatch
where the text cannot be the syntax it parses.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")
Parse = Generator[None, None, T]


class NoMatch(Exception):
    """The text at the cursor is not the syntax being parsed."""


class Source:
    __slots__ = ("final", "pos", "schemas", "text")

    def __init__(self, text: str, final: bool, schemas: dict[str, dict] | None = None) -> None:
        self.text = text
        self.pos = 0
        self.final = final
        # The request's tools' parameter schemas by function name: syntaxes that write
        # argument values as plain text (GLM-4.5, MiniMax-M2) type them by these.
        self.schemas = schemas or {}


def _more(src: Source) -> Parse[bool]:
    """Waits for a character at the cursor; False at the end of the text."""
    while src.pos >= len(src.text):
        if src.final:
            return False
        yield
    return True


def peek(src: Source) -> Parse[str | None]:
    if not (yield from _more(src)):
        return None
    return src.text[src.pos]


WHITESPACE = re.compile(r"[ \t\r\n]*")


def skip_ws(src: Source) -> Parse[None]:
    """Skips JSON whitespace (waiting to see what follows it)."""
    while (yield from _more(src)):
        src.pos = WHITESPACE.match(src.text, src.pos).end()
        if src.pos < len(src.text):
            return


def choose(src: Source, options: tuple[str, ...], end_ok: bool = False) -> Parse[str]:
    """Consumes the one of `options` the text continues with; with end_ok the end of the text
    (after the start of an option, or nothing) is accepted too and returns ""."""
    longest = max(map(len, options))
    while True:
        have = src.text[src.pos : src.pos + longest]
        for option in options:
            if have.startswith(option):
                src.pos += len(option)
                return option
        if not any(option.startswith(have) for option in options):
            raise NoMatch
        if src.final:
            if end_ok:
                src.pos = len(src.text)
                return ""
            raise NoMatch
        yield


def literal(src: Source, text: str, end_ok: bool = False) -> Parse[None]:
    yield from choose(src, (text,), end_ok)


def at_end(src: Source) -> Parse[bool]:
    return not (yield from _more(src))


_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


def bare_name(src: Source) -> Parse[str]:
    """A bare function name (letters, digits, `_.-`)."""
    start = src.pos
    while True:
        src.pos = _NAME.match(src.text, src.pos).end()
        if src.pos < len(src.text) or src.final:
            break
        yield
    if src.pos == start:
        raise NoMatch
    return src.text[start : src.pos]


def text_until(src: Source, end: str) -> Parse[str]:
    """The text from the cursor up to `end`, which is consumed; NoMatch if the text ends
    first. Each wait searches only the new text (and the start of `end` it may complete)."""
    start = search = src.pos
    while (found := src.text.find(end, search)) < 0:
        if src.final:
            raise NoMatch
        search = max(start, len(src.text) - len(end) + 1)
        yield
    src.pos = found + len(end)
    return src.text[start:found]
