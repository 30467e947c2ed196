"""Forced tool calls (tool_choice "required" or a named function): the JSON schema the
grammar forces the output to match (as vLLM forces it), and the calls read from such
output."""

from __future__ import annotations

import copy

from service.parsers.tool_calls.calls import ToolCall
from service.parsers.tool_calls.cursor import WHITESPACE, NoMatch, Parse, Source, T
from service.parsers.tool_calls.ids import new_id
from service.parsers.tool_calls.json_calls import call_list, object_text
from service.parsers.tool_calls.registry import family_named

_NO_PARAMETERS = {"type": "object", "properties": {}}


def _functions(tools: list[dict]) -> list[dict]:
    functions = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise ValueError('each tool must be {"type": "function", "function": {"name": ...}}')
        functions.append(function)
    return functions


def _parameters(function: dict) -> dict:
    return copy.deepcopy(function.get("parameters") or _NO_PARAMETERS)


def forced_calls_schema(tools: list[dict], name: str | None) -> dict:
    """The JSON schema forced output must match: for a named function its parameters schema
    (the output is the arguments object); for "required" (name None) a non-empty array of
    `{"name": <a tool's name>, "parameters": <its arguments>}`, as vLLM forces it. Each tool's
    `$defs`/`definitions` move to the root so that their "#/$defs/..." references resolve."""
    functions = _functions(tools)
    if name is not None:
        for function in functions:
            if function["name"] == name:
                return _parameters(function)
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    if not functions:
        raise ValueError("tool_choice 'required' needs at least one tool")
    alternatives, hoisted = [], {}
    for function in functions:
        parameters = _parameters(function)
        for key in ("$defs", "definitions"):
            for def_name, schema in (parameters.pop(key, None) or {}).items():
                defs = hoisted.setdefault(key, {})
                if defs.setdefault(def_name, schema) != schema:
                    raise ValueError(
                        f"tools define {key}/{def_name} differently; rename one of them"
                    )
        alternatives.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "const": function["name"]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    return {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}, **hoisted}


def _whole(parse: Parse[T], src: Source) -> T:
    """Runs a parser over a whole text, which it must take up to trailing whitespace."""
    try:
        parse.send(None)
    except StopIteration as stop:
        src.pos = WHITESPACE.match(src.text, src.pos).end()
        if src.pos != len(src.text):
            raise ValueError("forced tool-call output has text after its JSON") from None
        return stop.value
    except NoMatch:
        raise ValueError("forced tool-call output is not the JSON its schema asks for") from None
    raise AssertionError("a parser over a final text waited for more")


def forced_calls(text: str, name: str | None, parser: str = "hermes") -> list[ToolCall]:
    """The calls in output forced by `forced_calls_schema(tools, name)`: for a named function
    the text is its arguments object; for "required" an array of {"name", "parameters"}.
    Ids follow `parser`'s family (Mistral's are 9 characters). ValueError where the text is
    not such JSON (output cut short by max_tokens)."""
    short = family_named(parser).short_ids
    src = Source(text, final=True)
    if name is not None:
        return [ToolCall(new_id(short), name, _whole(object_text(src), src))]
    calls = _whole(call_list(src, ("parameters",)), src)
    return [ToolCall(new_id(short), n, arguments) for n, arguments in calls]
