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
    __slots__ = ("final", "pos", "text")

    def __init__(self, text: str, final: bool) -> None:
        self.text = text
        self.pos = 0
        self.final = final


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
