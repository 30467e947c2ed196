"""The "mistral" family (Mixtral, Mistral).

`[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects (tokenizers v2-v7:
Mixtral-8x22B-Instruct, Mistral-7B-Instruct-v0.3; an "id" member may be present), or
`[TOOL_CALLS]name[ARGS]{...}` and `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` per call (v11+),
as mistral-common decodes them. Its ids are 9 letters and digits, which its chat templates
and mistral-common require (as vLLM's mistral parser).

The markers are special tokens: the text must be decoded with them kept.
"""

from __future__ import annotations

from service.parsers.tool_calls.cursor import (
    Parse,
    Source,
    bare_name,
    choose,
    literal,
    peek,
    skip_ws,
)
from service.parsers.tool_calls.family import Family
from service.parsers.tool_calls.json_calls import Call, call_list, object_text

MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def _mistral_unit(src: Source) -> Parse[tuple[list[Call], bool]]:
    yield from literal(src, MISTRAL_CALLS)
    yield from skip_ws(src)
    if (yield from peek(src)) == "[":  # tokenizers v2-v7: a JSON list of calls
        return (yield from call_list(src, ("arguments",))), False
    name = yield from bare_name(src)  # v11+: name[ARGS]{...} or name[CALL_ID]id[ARGS]{...}
    if (yield from choose(src, (MISTRAL_ARGS, MISTRAL_CALL_ID))) == MISTRAL_CALL_ID:
        yield from bare_name(src)  # the model's own call id; ours replaces it
        yield from literal(src, MISTRAL_ARGS)
    return [(name, (yield from object_text(src)))], False


MISTRAL = Family((MISTRAL_CALLS,), _mistral_unit, short_ids=True)
