"""Reasoning in a model's output, separated from its answer (vLLM's reasoning parsers): the
`reasoning_content` of chat responses and of streamed deltas.

`parse_reasoning(name, text)` splits a finished completion into (reasoning, content);
`new_reasoning_stream(name)` does the same over the deltas of a streamed one (`feed` per
delta, `finish` at the end), and any chunking gives the whole text's split.

Parsers (`REASONING_PARSERS`, one module each; `reasoning_parser_for` picks one from a
checkpoint): "deepseek_r1" (deepseek_r1.py) and "minimax_m2" (minimax_m2.py), reasoning until
`</think>`; "glm45" (glm45.py), a `<think>...</think>` block the model opens itself (think.py
holds the three); "gpt_oss" (gpt_oss.py), harmony's `analysis` channel, whose tool calls it
also reads (service/parsers/harmony.py). Each parser's `end` is the text after which the
answer starts: structured outputs constrain the text after it, not the reasoning.

The tool-call parsers (service/parsers/tool_calls/) run on the content these hand on.
"""

from service.parsers.reasoning.registry import (
    REASONING_PARSERS,
    ReasoningParser,
    reasoning_parser_for,
    reasoning_parser_named,
)
from service.parsers.reasoning.stream import ReasoningDelta, ReasoningStream


def new_reasoning_stream(name: str) -> ReasoningStream:
    return reasoning_parser_named(name).stream()


def parse_reasoning(name: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole text, each None where empty."""
    stream = new_reasoning_stream(name)
    delta = stream.feed(text) + stream.finish()
    return delta.reasoning or None, delta.content or None


__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStream",
    "new_reasoning_stream",
    "parse_reasoning",
    "reasoning_parser_for",
    "reasoning_parser_named",
]
