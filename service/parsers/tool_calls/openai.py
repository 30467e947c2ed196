"""The "openai" family (gpt-oss): calls are harmony messages on the `commentary` channel to
`functions.NAME`, with the arguments' JSON as their content. They never appear in the content:
the gpt_oss reasoning parser reads the harmony channels (service/parsers/harmony.py) and hands
the calls on beside the content (service/reasoning.py), so here the content has no marker and
passes through as it is."""

from __future__ import annotations

from service.parsers.tool_calls.cursor import NoMatch, Parse, Source
from service.parsers.tool_calls.family import Family
from service.parsers.tool_calls.json_calls import Call


def _no_unit(src: Source) -> Parse[tuple[list[Call], bool]]:
    raise NoMatch  # no marker starts one: never called
    yield


OPENAI = Family((), _no_unit)
