"""gpt-oss: harmony messages (service/parsers/harmony.py). The `analysis` channel is the
reasoning; `final` (and `commentary` with no recipient, the preambles) the content, messages
of a kind joined by newlines, as vLLM's parse of harmony output; messages to `functions.NAME`
are tool calls, handed on whole for the `openai` tool-call parser to report."""

from __future__ import annotations

from service.parsers.harmony import HarmonyMessages
from service.parsers.reasoning.stream import ReasoningDelta

# where the answer starts: a structured-outputs grammar applies after it (vLLM's
# GptOssReasoningParser.is_reasoning_end looks for the same header)
END = "<|channel|>final<|message|>"


class GptOssReasoning:
    def __init__(self) -> None:
        self._messages = HarmonyMessages()

    def feed(self, text: str) -> ReasoningDelta:
        return _delta(self._messages.feed(text))

    def finish(self) -> ReasoningDelta:
        return _delta(self._messages.finish())


def _delta(pieces: list[tuple[str, object]]) -> ReasoningDelta:
    reasoning = "".join(t for k, t in pieces if k == "analysis")
    content = "".join(t for k, t in pieces if k == "content")
    return ReasoningDelta(reasoning, content, tuple(t for k, t in pieces if k == "call"))


def gpt_oss() -> GptOssReasoning:
    return GptOssReasoning()
