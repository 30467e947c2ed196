"""The "llama3_json" family (Llama 3.x, SmolLM2).

A JSON object `{"name": ..., "parameters"|"arguments": {...}}` that opens the output (or a
segment after a call), optionally after `<|python_tag|>`, several separated by `;` (vLLM's
llama3_json); and SmolLM2's `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`
(the function-calling format of SmolLM2-Instruct's model card and Ollama template; a single
object in the block is read too).

`<|python_tag|>` is a special token: the text must be decoded with it kept.
"""

from __future__ import annotations

from service.parsers.tool_calls.cursor import Parse, Source, at_end, literal, peek, skip_ws
from service.parsers.tool_calls.family import Family
from service.parsers.tool_calls.hermes import HERMES_CLOSE, HERMES_OPEN
from service.parsers.tool_calls.json_calls import Call, call_list, call_object

LLAMA_PYTHON_TAG = "<|python_tag|>"
_LLAMA_KEYS = ("arguments", "parameters")


def _llama_unit(src: Source) -> Parse[tuple[list[Call], bool]]:
    # The unit starts at one of its markers, complete: <tool_call>, <|python_tag|> or {.
    if src.text.startswith(HERMES_OPEN):  # SmolLM2: <tool_call>[{...}, ...]</tool_call>
        src.pos = len(HERMES_OPEN)
        yield from skip_ws(src)
        if (yield from peek(src)) == "[":
            calls = yield from call_list(src, _LLAMA_KEYS)
        else:
            calls = [(yield from call_object(src, _LLAMA_KEYS))]
        yield from skip_ws(src)
        yield from literal(src, HERMES_CLOSE, end_ok=True)
        return calls, False
    if src.text.startswith(LLAMA_PYTHON_TAG):
        src.pos = len(LLAMA_PYTHON_TAG)
    return [(yield from call_object(src, _LLAMA_KEYS))], True


def _llama_more(src: Source) -> Parse[tuple[list[Call], bool]]:
    yield from skip_ws(src)
    if (yield from at_end(src)):
        return [], False
    yield from literal(src, ";")
    return [(yield from call_object(src, _LLAMA_KEYS))], True


LLAMA3_JSON = Family((HERMES_OPEN, LLAMA_PYTHON_TAG), _llama_unit, _llama_more, True)
