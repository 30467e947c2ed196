"""The "glm45" family (GLM-4.5, 4.6, Air: Glm4MoeForCausalLM).

`<tool_call>NAME` then per argument `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`
(newlines between, as the GLM-4.5 chat template writes them) and `</tool_call>`, one block
per call (vLLM's glm45 parser). Values are text, typed as vLLM types them: one whose
property the tool's schema declares `"type": "string"` is kept as written; any other is read
as JSON, else as a Python literal, else kept as its stripped text.
"""

from __future__ import annotations

import ast
from typing import Any

from service.parsers.tool_calls.cursor import (
    Parse,
    Source,
    bare_name,
    choose,
    literal,
    skip_ws,
    text_until,
)
from service.parsers.tool_calls.family import Family
from service.parsers.tool_calls.json_calls import Call
from service.parsers.tool_calls.typed_values import (
    arguments_json,
    json_safe,
    property_schemas,
    strict_json,
)

GLM_OPEN, GLM_CLOSE = "<tool_call>", "</tool_call>"
GLM_KEY, GLM_KEY_END = "<arg_key>", "</arg_key>"
GLM_VALUE, GLM_VALUE_END = "<arg_value>", "</arg_value>"


def glm_value(text: str, schema: Any) -> Any:
    """An argument's value from its text and its property's schema (None if undeclared)."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    text = text.strip()
    try:
        return strict_json(text)
    except ValueError:
        pass
    try:  # Python literals the model may write: True, None, single-quoted strings
        return json_safe(ast.literal_eval(text))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text


def _glm_unit(src: Source) -> Parse[tuple[list[Call], bool]]:
    yield from literal(src, GLM_OPEN)
    yield from skip_ws(src)
    name = yield from bare_name(src)
    properties = property_schemas(src.schemas, name)
    arguments: dict[str, Any] = {}
    yield from skip_ws(src)
    # Until an argument is complete the end of the text is no call (it may be cut mid-name).
    tag = yield from choose(src, (GLM_KEY, GLM_CLOSE))
    while tag == GLM_KEY:
        key = (yield from text_until(src, GLM_KEY_END)).strip()
        yield from skip_ws(src)
        yield from literal(src, GLM_VALUE)
        value = yield from text_until(src, GLM_VALUE_END)
        arguments[key] = glm_value(value, properties.get(key))
        yield from skip_ws(src)
        tag = yield from choose(src, (GLM_KEY, GLM_CLOSE), end_ok=True)
    return [(name, arguments_json(arguments))], False


GLM45 = Family((GLM_OPEN,), _glm_unit)
