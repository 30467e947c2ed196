"""The "minimax_m2" family (MiniMax-M2: MiniMaxM2ForCausalLM).

`<minimax:tool_call>` then per call `<invoke name="NAME">` with `<parameter name="KEY">VALUE
</parameter>` per argument and `</invoke>`, and `</minimax:tool_call>` (the MiniMax-M2 chat
template; vLLM's minimax_m2 parser; names may be double-, single- or un-quoted). Values are
text, typed as vLLM types them: stripped; "null", "none" or "nil" is null; else the first of
the property's schema types (its type, type list, enum values, anyOf/oneOf/allOf) that the
text reads as, in the order integer, number, boolean, object/array, string; a property the
schema does not declare is a string.
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
from service.parsers.tool_calls.typed_values import arguments_json, property_schemas, strict_json

MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
MINIMAX_INVOKE, MINIMAX_INVOKE_END = "<invoke name=", "</invoke>"
MINIMAX_PARAM, MINIMAX_PARAM_END = "<parameter name=", "</parameter>"

# An enum value's type (bool before int: True is an int to Python).
_ENUM_TYPES = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)
_NULLS = ("null", "none", "nil")
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _schema_types(schema: Any) -> set[str]:
    """The types a property's schema allows, lower-cased: its type or type list, its enum
    values' types and its anyOf/oneOf/allOf choices' ({"string"} where it names none)."""
    types: set[str] = set()
    if isinstance(schema, dict):
        declared = schema.get("type")
        for t in [declared] if isinstance(declared, str) else _listed(declared):
            if isinstance(t, str):
                types.add(t.lower())
        for value in _listed(schema.get("enum")):
            kind = (
                "null"
                if value is None
                else next((name for cls, name in _ENUM_TYPES if isinstance(value, cls)), None)
            )
            if kind is not None:
                types.add(kind)
        for key in ("anyOf", "oneOf", "allOf"):
            for choice in _listed(schema.get(key)):
                types |= _schema_types(choice)
    return types or {"string"}


def _listed(value: Any) -> list:
    return value if isinstance(value, list) else []


def _as_number(text: str) -> int | float:
    value = float(text)
    return int(value) if value == int(value) else value  # OverflowError for infinity


def _as_bool(text: str) -> bool:
    word = text.lower().strip()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(text)


# Each type's reading of a value's text, in the order they are tried.
_READERS = (
    (("integer", "int"), int),
    (("number", "float"), _as_number),
    (("boolean", "bool"), _as_bool),
    (("object", "array"), strict_json),
    (("string", "str", "text"), str),
)


def minimax_value(text: str, schema: Any) -> Any:
    """An argument's value from its (stripped) text and its property's schema."""
    if text.lower() in _NULLS:
        return None
    types = _schema_types(schema)
    for names, read in _READERS:
        if types.intersection(names):
            try:
                return read(text)
            except (ValueError, OverflowError):
                continue
    try:
        return strict_json(text)
    except ValueError:
        return text


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
