"""What a tool-call family is to the stream that reads it: where its calls start and the
parsers that read them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from service.parsers.tool_calls.cursor import Parse, Source
from service.parsers.tool_calls.json_calls import Call

# A call as a unit reads it: (name, arguments' JSON text), and third the call's id where the
# model writes its own (Kimi-K2's "functions.NAME:IDX", which its chat template expects back).
UnitCall = Call | tuple[str, str, str]

# A family's `unit` parses from one of its markers and returns (calls, more): with more, its
# `more` parser runs next, on the text after the unit (the next call of a block, or its end).
Unit = Callable[[Source], Parse[tuple[list[UnitCall], bool]]]


@dataclass(frozen=True, slots=True)
class Family:
    markers: tuple[str, ...]  # where a call may start, anywhere in the text
    unit: Unit
    more: Unit | None = None
    bare_json: bool = False  # a "{" opening the output or a segment after a call starts one
    short_ids: bool = False  # 9-character ids (Mistral)
