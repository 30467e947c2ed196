"""The "deepseek_v31" family (DeepSeek-V3.1, V3.2-Exp).

`<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}`
`<｜tool▁call▁end｜>` and `<｜tool▁calls▁end｜>`: V3.1's chat template, which drops V3's
`function` type and ```json fence (vLLM's deepseek_v31 parser).
"""

from __future__ import annotations

from service.parsers.tool_calls.cursor import (
    Parse,
    Source,
    bare_name,
    choose,
    literal,
    skip_ws,
)
from service.parsers.tool_calls.deepseek import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
)
from service.parsers.tool_calls.family import Family
from service.parsers.tool_calls.json_calls import Call, object_text


def _v31_call(src: Source) -> Parse[Call]:
    """One call after its <｜tool▁call▁begin｜>."""
    name = yield from bare_name(src)
    yield from literal(src, DS_SEP)
    arguments = yield from object_text(src)
    yield from skip_ws(src)
    yield from literal(src, DS_CALL_END, end_ok=True)
    return name, arguments


def _v31_unit(src: Source) -> Parse[tuple[list[Call], bool]]:
    yield from literal(src, DS_CALLS_BEGIN)
    yield from skip_ws(src)
    yield from literal(src, DS_CALL_BEGIN)
    return [(yield from _v31_call(src))], True


def _v31_more(src: Source) -> Parse[tuple[list[Call], bool]]:
    yield from skip_ws(src)
    if (yield from choose(src, (DS_CALL_BEGIN, DS_CALLS_END), end_ok=True)) != DS_CALL_BEGIN:
        return [], False
    return [(yield from _v31_call(src))], True


DEEPSEEK_V31 = Family((DS_CALLS_BEGIN,), _v31_unit, _v31_more)
