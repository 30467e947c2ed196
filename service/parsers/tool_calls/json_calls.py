"""JSON (RFC 8259) validated as it arrives, so that a broken call fails where it breaks, and
the call objects and lists the families write in it.

A call is a JSON object with a non-empty string "name" and an object of arguments (under one
of the family's argument keys; an object encoded as a JSON string is accepted); other
members are ignored. Its arguments are the object's JSON text as the model wrote it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from service.parsers.tool_calls.cursor import NoMatch, Parse, Source, literal, peek, skip_ws

Call = tuple[str, str]  # name, arguments

_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_NUMBER_RUN = re.compile(r"[-+0-9.eE]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_MAX_DEPTH = 64
_Span = tuple[int, int]


def _wait_for(src: Source, n: int) -> Parse[None]:
    """Waits until n characters are at the cursor."""
    while len(src.text) - src.pos < n:
        if src.final:
            raise NoMatch
        yield


def _string(src: Source) -> Parse[None]:
    src.pos += 1  # the opening quote
    while True:
        src.pos = _STRING_RUN.match(src.text, src.pos).end()
        if src.pos == len(src.text):
            if src.final:
                raise NoMatch
            yield
            continue
        c = src.text[src.pos]
        if c == '"':
            src.pos += 1
            return
        if c != "\\":  # a raw control character
            raise NoMatch
        yield from _wait_for(src, 2)
        escape = src.text[src.pos + 1]
        if escape in '"\\/bfnrt':
            src.pos += 2
        elif escape == "u":
            yield from _wait_for(src, 6)
            if not _HEX4.fullmatch(src.text, src.pos + 2, src.pos + 6):
                raise NoMatch
            src.pos += 6
        else:
            raise NoMatch


def _number(src: Source) -> Parse[None]:
    start = src.pos
    while True:
        end = _NUMBER_RUN.match(src.text, start).end()
        if end < len(src.text) or src.final:
            break
        yield
    if not _NUMBER.fullmatch(src.text, start, end):
        raise NoMatch
    src.pos = end


def _object(src: Source, depth: int, members: dict[str, _Span] | None) -> Parse[None]:
    src.pos += 1  # {
    yield from skip_ws(src)
    if (yield from peek(src)) == "}":
        src.pos += 1
        return
    while True:
        yield from skip_ws(src)
        if (yield from peek(src)) != '"':
            raise NoMatch
        key_start = src.pos
        yield from _string(src)
        key_end = src.pos
        yield from skip_ws(src)
        yield from literal(src, ":")
        span = yield from _value(src, depth + 1)
        if members is not None:
            members[json.loads(src.text[key_start:key_end])] = span
        yield from skip_ws(src)
        c = yield from peek(src)
        src.pos += 1
        if c == "}":
            return
        if c != ",":
            raise NoMatch


def _array(src: Source, depth: int) -> Parse[None]:
    src.pos += 1  # [
    yield from skip_ws(src)
    if (yield from peek(src)) == "]":
        src.pos += 1
        return
    while True:
        yield from _value(src, depth + 1)
        yield from skip_ws(src)
        c = yield from peek(src)
        src.pos += 1
        if c == "]":
            return
        if c != ",":
            raise NoMatch


def _value(src: Source, depth: int = 0, members: dict[str, _Span] | None = None) -> Parse[_Span]:
    """One JSON value after optional whitespace; its span. With `members`, an object's
    member spans are recorded there (the last of a repeated key wins, as in json.loads)."""
    if depth > _MAX_DEPTH:
        raise NoMatch
    yield from skip_ws(src)
    c = yield from peek(src)
    start = src.pos
    if c == "{":
        yield from _object(src, depth, members)
    elif c == "[":
        yield from _array(src, depth)
    elif c == '"':
        yield from _string(src)
    elif c is not None and c in "-0123456789":
        yield from _number(src)
    elif c == "t":
        yield from literal(src, "true")
    elif c == "f":
        yield from literal(src, "false")
    elif c == "n":
        yield from literal(src, "null")
    else:
        raise NoMatch
    return start, src.pos


def object_text(src: Source) -> Parse[str]:
    """A JSON object (after optional whitespace); its text."""
    yield from skip_ws(src)
    if (yield from peek(src)) != "{":
        raise NoMatch
    start, end = yield from _value(src)
    return src.text[start:end]


def _strict_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _arguments(raw: str) -> str:
    """The arguments' JSON text: an object, or a JSON string holding an object's text."""
    value = json.loads(raw)
    if isinstance(value, str):
        raw = value.strip()
        try:
            value = json.loads(raw, parse_constant=_strict_constant)
        except ValueError:
            raise NoMatch from None
    if not isinstance(value, dict):
        raise NoMatch
    return raw


def call_object(src: Source, arg_keys: tuple[str, ...]) -> Parse[Call]:
    """`{"name": ..., <one of arg_keys>: {...}, ...}` (after optional whitespace)."""
    yield from skip_ws(src)
    if (yield from peek(src)) != "{":
        raise NoMatch
    members: dict[str, _Span] = {}
    yield from _value(src, 0, members)
    if "name" not in members:
        raise NoMatch
    name = json.loads(src.text[slice(*members["name"])])
    present = [key for key in arg_keys if key in members]
    if not isinstance(name, str) or not name or len(present) != 1:
        raise NoMatch
    return name, _arguments(src.text[slice(*members[present[0]])])


def call_list(src: Source, arg_keys: tuple[str, ...]) -> Parse[list[Call]]:
    """A JSON array of call objects (after optional whitespace)."""
    yield from skip_ws(src)
    if (yield from peek(src)) != "[":
        raise NoMatch
    src.pos += 1
    calls: list[Call] = []
    yield from skip_ws(src)
    if (yield from peek(src)) == "]":
        src.pos += 1
        return calls
    while True:
        calls.append((yield from call_object(src, arg_keys)))
        yield from skip_ws(src)
        c = yield from peek(src)
        src.pos += 1
        if c == "]":
            return calls
        if c != ",":
            raise NoMatch
