"""Argument values that a syntax writes as plain text (GLM-4.5's, MiniMax-M2's): the
request's schemas that type them, and the strict JSON they end up as.

Each family types a value by its own rule (vLLM's for that family); what they share is
here: the called function's property schemas, JSON read without NaN or Infinity (which
would make the arguments invalid JSON), and the arguments object's text.
"""

from __future__ import annotations

import json
from typing import Any


def parameter_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """Function name -> its parameters schema, for the tools of a request (OpenAI's form)."""
    schemas: dict[str, dict] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            schemas[function["name"]] = parameters if isinstance(parameters, dict) else {}
    return schemas


def property_schemas(schemas: dict[str, dict], function: str) -> dict[str, Any]:
    """The schemas of `function`'s properties (empty for an unknown function)."""
    properties = schemas.get(function, {}).get("properties")
    return properties if isinstance(properties, dict) else {}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def json_safe(value: Any) -> Any:
    """`value` if it is JSON (no NaN or infinity, no sets, bytes or complex numbers);
    ValueError otherwise."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, RecursionError) as exc:
        raise ValueError(str(exc)) from None
    return value


def strict_json(text: str) -> Any:
    """The JSON value `text` holds; ValueError where it is not JSON (NaN, Infinity and
    numbers that overflow to infinity included) or nests too deep to read."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deep") from None
    return json_safe(value)


def arguments_json(arguments: dict[str, Any]) -> str:
    """The arguments object's JSON text (as vLLM writes it: non-ASCII kept)."""
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
