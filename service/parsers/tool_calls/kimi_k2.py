"""The "kimi_k2" family (Kimi-K2: DeepseekV3ForCausalLM checkpoints).

`<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:IDX`
`<|tool_call_argument_begin|>{...}<|tool_call_end|>` and `<|tool_calls_section_end|>` (the
singular `<|tool_call_section_begin|>`/`_end|>` the model sometimes writes is read too), as
vLLM's kimi_k2 parser reads them. The call's id is the model's own `functions.NAME:IDX` (as
vLLM returns it): Kimi's chat template writes it back in the conversation.

The markers are special tokens: the text must be decoded with them kept.
"""

from __future__ import annotations

import re

from service.parsers.tool_calls.cursor import NoMatch, Parse, Source, choose, literal, skip_ws
from service.parsers.tool_calls.family import Family
from service.parsers.tool_calls.json_calls import object_text

KIMI_SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
KIMI_SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
KIMI_CALL_BEGIN, KIMI_ARGS, KIMI_CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
_ID_RUN = re.compile(r"[A-Za-z0-9_.:\-]*")
# functions.NAME:IDX (or NAME:IDX); the name is the last dotted part before the colon.
_ID = re.compile(r"(?:[A-Za-z0-9_\-]+\.)*([A-Za-z0-9_\-]+):[0-9]+")
KimiCall = tuple[str, str, str]  # name, arguments, the model's id


def _call_id(src: Source) -> Parse[re.Match]:
    """The `functions.NAME:IDX` id (after optional whitespace)."""
    yield from skip_ws(src)
    start = src.pos
    while True:
        src.pos = _ID_RUN.match(src.text, src.pos).end()
        if src.pos < len(src.text) or src.final:
            break
        yield
    match = _ID.fullmatch(src.text, start, src.pos)
    if match is None:
        raise NoMatch
    return match


def _kimi_call(src: Source) -> Parse[KimiCall]:
    """One call after its <|tool_call_begin|>."""
    match = yield from _call_id(src)
    yield from skip_ws(src)
    yield from literal(src, KIMI_ARGS)
    arguments = yield from object_text(src)
    yield from skip_ws(src)
    yield from literal(src, KIMI_CALL_END, end_ok=True)
    return match[1], arguments, match[0]


def _kimi_unit(src: Source) -> Parse[tuple[list[KimiCall], bool]]:
    yield from choose(src, KIMI_SECTION_BEGIN)
    yield from skip_ws(src)
    yield from literal(src, KIMI_CALL_BEGIN)
    return [(yield from _kimi_call(src))], True


def _kimi_more(src: Source) -> Parse[tuple[list[KimiCall], bool]]:
    yield from skip_ws(src)
    ends = (KIMI_CALL_BEGIN, *KIMI_SECTION_END)
    if (yield from choose(src, ends, end_ok=True)) != KIMI_CALL_BEGIN:
        return [], False
    return [(yield from _kimi_call(src))], True


KIMI_K2 = Family(KIMI_SECTION_BEGIN, _kimi_unit, _kimi_more)
