"""What a reasoning parser hands on for each piece of text it is fed."""

from __future__ import annotations

from typing import NamedTuple, Protocol


class ReasoningDelta(NamedTuple):
    """The reasoning and the content (the answer) a piece of model text settles; `calls` are
    the (name, arguments) tool calls of syntaxes that keep them outside the content (gpt-oss's
    harmony channels), each once it is complete."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[tuple[str, str], ...] = ()

    def __add__(self, other: ReasoningDelta) -> ReasoningDelta:  # type: ignore[override]
        return ReasoningDelta(
            self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls
        )


class ReasoningStream(Protocol):
    """One choice's text fed delta by delta (`feed`), then `finish`. Text that may still turn
    out to be (part of) a marker is held back until that is settled, so any chunking of a text
    gives the same reasoning and content as the whole text."""

    def feed(self, text: str) -> ReasoningDelta: ...

    def finish(self) -> ReasoningDelta: ...
