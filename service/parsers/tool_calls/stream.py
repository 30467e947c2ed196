"""Tool calls in a model's text, whole or streamed: content and calls, the same for any
chunking of the text."""

from __future__ import annotations

from collections.abc import Generator

from service.parsers.tool_calls.calls import ToolCall, ToolCallDelta
from service.parsers.tool_calls.cursor import NoMatch, Source
from service.parsers.tool_calls.family import UnitCall
from service.parsers.tool_calls.ids import new_id
from service.parsers.tool_calls.registry import family_named
from service.parsers.tool_calls.typed_values import parameter_schemas


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of a marker."""
    held = 0
    for m in markers:
        i = text.find(m[0], max(0, len(text) - len(m) + 1))
        while i != -1:
            if m.startswith(text[i:]):
                held = max(held, len(text) - i)
                break
            i = text.find(m[0], i + 1)
    return held


class ToolCallStream:
    """Tool calls of one streamed choice: `feed` each text delta, then `finish`.

    Each returns the content to send now and the tool-call deltas to send now. Text that
    may still turn out to be (part of) a call is held back until that is settled; `calls`
    holds the complete calls so far, with the ids their deltas carried. `tools` (the request's,
    OpenAI's form) type the argument values of syntaxes that write them as plain text.
    """

    def __init__(self, parser: str, tools: list[dict] | None = None) -> None:
        self._family = family_named(parser)
        self._schemas = parameter_schemas(tools)
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not yet sent as content: a possible start of a marker
        self._ws = ""  # whitespace held while the current segment has nothing else
        self._in_text = False  # the current segment (since the last call) has other text
        self._after_call = False  # a call block has been read
        self._unit: Generator | None = None  # the parser running over self._src
        self._src: Source | None = None
        self._marker: str | None = None  # the marker it started at (None: a `more` parser)
        self._done = False

    def feed(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        if self._unit is not None:
            self._src.text += delta_text
        else:
            self._pending += delta_text
        return self._run()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._done:
            raise RuntimeError("finish() called twice")
        self._done = True
        if self._src is not None:
            self._src.final = True
        content, deltas = self._run()
        if self._ws and not self._after_call:  # whitespace and nothing else
            content += self._ws
        self._ws = ""
        return content, deltas

    def _run(self) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._unit is None:
                if not self._scan_text(content):
                    break
                continue
            try:
                self._unit.send(None)
                break  # waiting for more text
            except StopIteration as stop:
                calls, more = stop.value
                self._take(calls, deltas)
                rest = self._src.text[self._src.pos :]
                if more:
                    self._start(rest, None)
                else:
                    self._unit = self._src = None
                    self._pending = rest
            except NoMatch:
                text = self._src.text
                self._unit = self._src = None
                if self._marker is not None:  # not a call after all: the marker is content
                    self._emit(self._marker, content)
                    text = text[len(self._marker) :]
                self._pending = text
        return "".join(content), deltas

    def _scan_text(self, content: list[str]) -> bool:
        """Sends content up to the next call marker and starts parsing there (True), or
        sends what cannot start a marker and holds the rest (False)."""
        text, family = self._pending, self._family
        at, marker = -1, None
        for m in family.markers:
            i = text.find(m)
            if i >= 0 and (at < 0 or i < at):
                at, marker = i, m
        if family.bare_json and not self._in_text:
            j = len(text) - len(text.lstrip())
            if j < len(text) and text[j] == "{" and (at < 0 or j < at):
                at, marker = j, "{"
        if marker is not None:
            self._emit(text[:at], content)
            self._pending = ""
            self._start(text[at:], marker)
            return True
        keep = 0 if self._done else _held_suffix(text, family.markers)
        self._emit(text[: len(text) - keep], content)
        self._pending = text[len(text) - keep :]
        return False

    def _start(self, text: str, marker: str | None) -> None:
        self._src = Source(text, self._done, self._schemas)
        self._marker = marker
        parse = self._family.unit if marker is not None else self._family.more
        self._unit = parse(self._src)

    def _emit(self, text: str, content: list[str]) -> None:
        if not text:
            return
        if not self._in_text:
            if text.isspace():  # held: dropped if a call follows, sent if other text does
                self._ws += text
                return
            text, self._ws, self._in_text = self._ws + text, "", True
        content.append(text)

    def _take(self, calls: list[UnitCall], deltas: list[ToolCallDelta]) -> None:
        self._ws, self._in_text, self._after_call = "", False, True
        for name, arguments, *own_id in calls:
            call_id = own_id[0] if own_id else new_id(self._family.short_ids)
            call = ToolCall(call_id, name, arguments)
            deltas.append(ToolCallDelta(len(self.calls), call.id, name, arguments))
            self.calls.append(call)


def parse_tool_calls(
    parser: str, text: str, tools: list[dict] | None = None
) -> tuple[str | None, list[ToolCall]]:
    """(the content outside the calls, None if there is none; the calls) of a whole text."""
    stream = ToolCallStream(parser, tools)
    content, _ = stream.feed(text)
    rest, _ = stream.finish()
    return (content + rest) or None, stream.calls
