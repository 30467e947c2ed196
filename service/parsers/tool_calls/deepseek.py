"""The "deepseek" family (DeepSeek-V2/V2.5/V3).

`<｜tool▁calls▁begin｜>` then per call
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`
(separated by newlines) and `<｜tool▁calls▁end｜>` (the V2.5/V3 chat templates; vLLM's and
SGLang's deepseekv3 parsers); the V3.1 form `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}`
`<｜tool▁call▁end｜>` is read too.
"""

from __future__ import annotations

from service.parsers.tool_calls.cursor import (
    NoMatch,
    Parse,
    Source,
    bare_name,
    choose,
    literal,
    peek,
    skip_ws,
)
from service.parsers.tool_calls.family import Family
from service.parsers.tool_calls.json_calls import Call, object_text

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)


def _deepseek_call(src: Source) -> Parse[Call]:
    """One call after its <｜tool▁call▁begin｜>."""
    first = yield from bare_name(src)
    yield from literal(src, DS_SEP)
    if (yield from peek(src)) == "{":  # V3.1: NAME<sep>{...}
        name, args = first, (yield from object_text(src))
    else:  # V2, V2.5, V3: function<sep>NAME\n```json\n{...}\n```
        if first != "function":
            raise NoMatch
        name = yield from bare_name(src)
        yield from skip_ws(src)
        yield from literal(src, "```json")
        args = yield from object_text(src)
        yield from skip_ws(src)
        yield from literal(src, "```", end_ok=True)
    yield from skip_ws(src)
    yield from literal(src, DS_CALL_END, end_ok=True)
    return name, args


def _deepseek_unit(src: Source) -> Parse[tuple[list[Call], bool]]:
    yield from literal(src, DS_CALLS_BEGIN)
    yield from skip_ws(src)
    yield from literal(src, DS_CALL_BEGIN)
    return [(yield from _deepseek_call(src))], True


def _deepseek_more(src: Source) -> Parse[tuple[list[Call], bool]]:
    yield from skip_ws(src)
    if (yield from choose(src, (DS_CALL_BEGIN, DS_CALLS_END), end_ok=True)) != DS_CALL_BEGIN:
        return [], False
    return [(yield from _deepseek_call(src))], True


DEEPSEEK = Family((DS_CALLS_BEGIN,), _deepseek_unit, _deepseek_more)
