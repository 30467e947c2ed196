"""The tool calls the parsers hand to the API: whole calls and their streamed deltas."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One item of an OpenAI streaming `delta.tool_calls`: id and name on a call's first
    delta, argument text after (here a call's one delta carries all three)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
