"""The "minimax_m2" family (MiniMax-M2: MiniMaxM2ForCausalLM).

`<minimax:tool_call>` then per call `<invoke name="NAME">` with `<parameter name="KEY">VALUE
</parameter>` per argument and `</invoke>`, and `</minimax:tool_call>` (the MiniMax-M2 chat
template; vLLM's minimax_m2 parser; names may be double-, single- or un-quoted). Values are
text, stripped and typed by the tool's schema as vLLM types them (minimax_values.py).
"""

from __future__ import annotations

import re
from typing import Any

from service.parsers.tool_calls.cursor import (
    NoMatch,
    Parse,
    Source,
    choose,
    literal,
    skip_ws,
    text_until,
)
from service.parsers.tool_calls.family import Family
from service.parsers.tool_calls.json_calls import Call
from service.parsers.tool_calls.minimax_values import minimax_value
from service.parsers.tool_calls.typed_values import arguments_json, property_schemas

MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
MINIMAX_INVOKE, MINIMAX_INVOKE_END = "<invoke name=", "</invoke>"
MINIMAX_PARAM, MINIMAX_PARAM_END = "<parameter name=", "</parameter>"
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def _tag_name(src: Source) -> Parse[str]:
    """A name after `name=` up to the tag's `>`, its quotes taken off."""
    name = (yield from text_until(src, ">")).strip()
    if "<" in name or "\n" in name:  # a tag left open: not this syntax
        raise NoMatch
    if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
        name = name[1:-1]
    return name


def _invoke(src: Source) -> Parse[Call]:
    """One call after its `<invoke name=`."""
    name = yield from _tag_name(src)
    if not _FUNCTION_NAME.fullmatch(name):
        raise NoMatch
    properties = property_schemas(src.schemas, name)
    arguments: dict[str, Any] = {}
    yield from skip_ws(src)
    # Until a parameter is complete the end of the text is no call.
    tag = yield from choose(src, (MINIMAX_PARAM, MINIMAX_INVOKE_END))
    while tag == MINIMAX_PARAM:
        key = yield from _tag_name(src)
        value = (yield from text_until(src, MINIMAX_PARAM_END)).strip()
        arguments[key] = minimax_value(value, properties.get(key))
        yield from skip_ws(src)
        tag = yield from choose(src, (MINIMAX_PARAM, MINIMAX_INVOKE_END), end_ok=True)
    return name, arguments_json(arguments)


def _minimax_unit(src: Source) -> Parse[tuple[list[Call], bool]]:
    yield from literal(src, MINIMAX_OPEN)
    yield from skip_ws(src)
    yield from literal(src, MINIMAX_INVOKE)
    return [(yield from _invoke(src))], True


def _minimax_more(src: Source) -> Parse[tuple[list[Call], bool]]:
    yield from skip_ws(src)
    ends = (MINIMAX_INVOKE, MINIMAX_CLOSE)
    if (yield from choose(src, ends, end_ok=True)) != MINIMAX_INVOKE:
        return [], False
    return [(yield from _invoke(src))], True


MINIMAX_M2 = Family((MINIMAX_OPEN,), _minimax_unit, _minimax_more)
