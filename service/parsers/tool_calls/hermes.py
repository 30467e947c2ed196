"""The "hermes" family (Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE; the demo model).

`<tool_call>` JSON `{"name": ..., "arguments": {...}}` `</tool_call>`, one block per call
(the format the Qwen2.5/Qwen3 chat templates teach; vLLM's and SGLang's "hermes"/"qwen25"
parsers).
"""

from __future__ import annotations

from service.parsers.tool_calls.cursor import Parse, Source, literal, skip_ws
from service.parsers.tool_calls.family import Family
from service.parsers.tool_calls.json_calls import Call, call_object

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def _hermes_unit(src: Source) -> Parse[tuple[list[Call], bool]]:
    yield from literal(src, HERMES_OPEN)
    call = yield from call_object(src, ("arguments",))
    yield from skip_ws(src)
    yield from literal(src, HERMES_CLOSE, end_ok=True)
    return [call], False


HERMES = Family((HERMES_OPEN,), _hermes_unit)
