"""The OpenAPI document served at /schema/openapi.json, made to say what the server does.

Litestar builds the paths and operations (with the error responses each route declares
through openapi_errors.py's `errors()`). Its schemas of msgspec Structs lose constraints
(ranges inside unions, minLength, additionalProperties: false, enums of neutral values), so
the component schemas come from msgspec's own generator instead, which reads the same
annotations the decoder enforces. On top: the served model's limits (token ids below the
vocabulary size, max_tokens below the context length), the rules that span fields, the SSE
alternative of the streaming operations, and bearer auth when an API key is set.
"""

from __future__ import annotations

import inspect
from typing import Any

import msgspec
from litestar import Request
from litestar.openapi.plugins import JsonRenderPlugin

from service import responses as response_bodies
from service import schemas
from service.inspector import schemas as inspector_bodies

# Rules across fields, which one field's annotation cannot state.
_STRUCT_RULES = {
    "TokenizeRequest": {
        "oneOf": [
            {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
            {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
        ]
    },
    "StructuredOutputsBody": {
        "oneOf": [
            *(
                {"required": [k], "properties": {k: {"not": {"type": "null"}}}}
                for k in ("json", "regex", "choice", "grammar")
            ),
            {"required": ["json_object"], "properties": {"json_object": {"const": True}}},
        ]
    },
    "ChatCompletionRequest": {
        "allOf": [
            {
                "if": {
                    "required": ["top_logprobs"],
                    "properties": {"top_logprobs": {"type": "integer"}},
                },
                "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
            },
            {  # a tool_choice other than "none" needs tools
                "if": {
                    "required": ["tool_choice"],
                    "properties": {"tool_choice": {"not": {"enum": [None, "none"]}}},
                },
                "then": {
                    "required": ["tools"],
                    "properties": {"tools": {"type": "array", "minItems": 1}},
                },
            },
        ]
    },
}
_REF = "#/components/schemas/"
_STREAMED = {
    "createCompletion": "CompletionResponse",
    "createChatCompletion": "ChatCompletionChunk",
}


def _event(chunk: str) -> dict:
    """One SSE event of a stream (before OpenAPI 3.2 a stream's `schema` describes an event):
    a chunk as JSON, or `[DONE]` to end it."""
    data = {"contentMediaType": "application/json", "contentSchema": {"$ref": _REF + chunk}}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string", "anyOf": [{"const": "[DONE]"}, data]}},
    }


class TruthfulOpenAPI(JsonRenderPlugin):
    """Renders Litestar's document with the corrections above, computed on first use (from
    the served model) once per API-key setting, which tests may flip on a live server."""

    def __init__(self) -> None:
        super().__init__()
        self._rendered: dict[bool, bytes] = {}

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        state = request.app.state.serving
        secured = state.keys.required
        if secured not in self._rendered:
            limits = {
                "TokenId": state.engine.args.vocab_size - 1,
                "MaxTokens": state.engine.max_model_len - 1,
            }
            document = msgspec.json.decode(msgspec.json.encode(openapi_schema))  # a deep copy
            self._rendered[secured] = msgspec.json.encode(_correct(document, secured, limits))
        return self._rendered[secured]


def _correct(document: dict, secured: bool, limits: dict[str, int]) -> dict:
    components = document.setdefault("components", {})
    structs = [
        t
        for module in (schemas, response_bodies, inspector_bodies)
        for _, t in inspect.getmembers(module, inspect.isclass)
        if issubclass(t, msgspec.Struct) and not t.__name__.startswith("_")
    ]
    _, found = msgspec.json.schema_components(structs, ref_template=_REF + "{name}")
    for name, rules in _STRUCT_RULES.items():
        found[name].update(rules)
    found["TokenId"] = {"type": "integer", "minimum": 0, "maximum": limits["TokenId"]}
    components["schemas"] = {name: _limit(s, limits) for name, s in found.items()}
    if secured:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path in document.get("paths", {}).values():
        for operation in path.values():
            responses = operation.get("responses", {})
            if secured and "401" in responses:
                operation["security"] = [{"bearer": []}]
            chunk = _STREAMED.get(operation.get("operationId"))
            if chunk is not None:
                responses["200"]["content"]["text/event-stream"] = {"schema": _event(chunk)}
    return document


def _limit(node: Any, limits: dict[str, int]) -> Any:
    """The served model's limits where the schemas name them (titles of
    inference/sampling_params.py's annotations)."""
    if isinstance(node, list):
        return [_limit(n, limits) for n in node]
    if not isinstance(node, dict):
        return node
    title = node.get("title")
    if title == "TokenId":
        return {"$ref": _REF + "TokenId"}
    node = {k: _limit(v, limits) for k, v in node.items()}
    if title == "MaxTokens":
        node["maximum"] = limits["MaxTokens"]
    return node
