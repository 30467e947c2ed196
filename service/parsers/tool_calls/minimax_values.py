"""MiniMax-M2's argument values, text typed by the tool's JSON schema as vLLM's minimax_m2
parser types them: "null", "none" or "nil" is null; else the first of the property's schema
types (its type or type list, its enum values' types, its anyOf/oneOf/allOf choices') that
the text reads as, tried in the order integer, number, boolean, object/array, string; then
JSON; then the text. A property the schema does not declare is a string.
"""

from __future__ import annotations

from typing import Any

from service.parsers.tool_calls.typed_values import strict_json

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
        types.update(filter(None, map(_enum_type, _listed(schema.get("enum")))))
        for key in ("anyOf", "oneOf", "allOf"):
            for choice in _listed(schema.get(key)):
                types |= _schema_types(choice)
    return types or {"string"}


def _enum_type(value: Any) -> str | None:
    if value is None:
        return "null"
    return next((name for cls, name in _ENUM_TYPES if isinstance(value, cls)), None)


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
