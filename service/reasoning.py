"""Reasoning output and the answer, once for both APIs (SPEC section 13).

A chat request's ReasoningPlan names the reasoning parser that applies to it (--reasoning-parser,
or its checkpoint's under `auto`; service/parsers/reasoning/), unless the prompt has already
closed the reasoning (a template with thinking turned off writes the end marker into it: the
whole output is then the answer). Each choice's text then goes through a ChoiceParse: the
reasoning parser separates `reasoning_content`, and the tool plan (service/tools.py) reads the
content it hands on. gpt-oss writes its tool calls in harmony channels rather than in the
content: the gpt_oss parser hands them on and the `openai` tool-call parser reports them.

A grammar (response_format, structured_outputs, a forced tool call) constrains the answer, not
the reasoning: the engine is given the parser's end marker (SamplingParams.reasoning_end) and
starts the grammar after it, as vLLM does; vLLM's `--structured-outputs-config
'{"enable_in_reasoning": true}'` makes it constrain the whole output instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from inference import StructuredOutputs
from service.parsers.reasoning import ReasoningDelta, ReasoningStream, reasoning_parser_named
from service.parsers.reasoning.gpt_oss import GptOssReasoning
from service.parsers.tool_calls import ToolCall, ToolCallDelta, new_call_id
from service.tools import ChoiceToolCalls, ToolPlan

if TYPE_CHECKING:  # service.state imports this module
    from service.state import ServingState

HARMONY_TOOL_PARSER = "openai"
_PROMPT_TAIL_TOKENS = 16  # enough for any parser's end marker


def enable_in_reasoning(config: str | None) -> bool:
    """vLLM's --structured-outputs-config (JSON) -> its enable_in_reasoning; ValueError names
    what is wrong."""
    if not config:
        return False
    try:
        options = json.loads(config)
    except ValueError as exc:
        raise ValueError(f"--structured-outputs-config is not JSON: {exc}") from None
    if not isinstance(options, dict) or set(options) - {"enable_in_reasoning"}:
        raise ValueError(
            f'--structured-outputs-config takes {{"enable_in_reasoning": true|false}}, got {config}'
        )
    value = options.get("enable_in_reasoning", False)
    if not isinstance(value, bool):
        raise ValueError(  # noqa: TRY004 - a bad setting, reported as the others
            "--structured-outputs-config: enable_in_reasoning must be true or false"
        )
    return value


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    parser: str  # a reasoning parser's name (service/parsers/reasoning/)
    include: bool = True  # vLLM's include_reasoning: false parses it out and drops it
    held: bool = False  # SGLang's stream_reasoning false: streamed in one delta once it ends

    @property
    def end(self) -> str:
        return reasoning_parser_named(self.parser).end

    def stream(self) -> ReasoningStream:
        return reasoning_parser_named(self.parser).stream()


def reasoning_plan(
    parser: str | None,
    tokenizer,
    prompt_ids: list[int],
    include: bool = True,
    held: bool = False,
) -> ReasoningPlan | None:
    """The plan of a chat request whose model reasons with `parser` (None: it does not)."""
    if parser is None:
        return None
    plan = ReasoningPlan(parser, include, held)
    tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return None if tail.rstrip().endswith(plan.end) else plan


def reasoning_end(
    state: ServingState, reasoning: ReasoningPlan | None, constraint: StructuredOutputs | None
) -> str | None:
    """SamplingParams.reasoning_end: where a constrained request's grammar starts (None: at the
    start of the output)."""
    if reasoning is None or constraint is None or state.grammar_in_reasoning:
        return None
    return reasoning.end


def skip_special_tokens(
    asked: bool | None, tools: ToolPlan | None, reasoning: ReasoningPlan | None
) -> bool | None:
    """The engine's skip_special_tokens: where the request does not say, the text keeps special
    tokens under a reasoning parser, whose markers may be ones (harmony's all are), as under
    tool_choice auto (ToolPlan.skip_special_tokens). Where it says true (vLLM's router always
    does) the parsers still read the markers, and the render drops the special tokens from what
    they hand on (special_texts), as vLLM's parsers on token ids do."""
    if asked is not False and _parsed_markers(tools, reasoning):
        return False
    return tools.skip_special_tokens(asked) if tools is not None else asked


def special_texts(
    asked: bool | None, tools: ToolPlan | None, reasoning: ReasoningPlan | None, tokenizer
) -> tuple[str, ...]:
    """The special tokens' texts a chat render removes from content and reasoning: those the
    engine kept for the parsers although the request asked them skipped."""
    if asked is not True or not _parsed_markers(tools, reasoning):
        return ()
    specials = getattr(tokenizer, "all_special_tokens", None) or ()
    return tuple(sorted((t for t in specials if t), key=len, reverse=True))


def _parsed_markers(tools: ToolPlan | None, reasoning: ReasoningPlan | None) -> bool:
    return reasoning is not None or (tools is not None and tools.choice == "auto")


def _without(text: str, specials: tuple[str, ...]) -> str:
    for special in specials:  # longest first: no special token's text hides in another's
        text = text.replace(special, "")
    return text


class ChoicePiece(NamedTuple):
    reasoning: str
    content: str
    tool_calls: list[ToolCallDelta]


class ChoiceParse:
    """One choice's text as reasoning, content and tool calls, fed delta by delta: `feed` and
    `finish` return what to send now; `calls` holds the choice's calls once finished."""

    def __init__(
        self,
        reasoning: ReasoningPlan | None,
        tools: ToolPlan | None,
        specials: tuple[str, ...] = (),
    ) -> None:
        self.tools = tools
        self._harmony_calls = tools is not None and tools.parser == HARMONY_TOOL_PARSER
        self._show_reasoning = reasoning is not None and reasoning.include
        self._hold = reasoning is not None and reasoning.held
        self._held = ""  # reasoning kept back until it ends (ReasoningPlan.held)
        self._specials = specials  # removed from what is handed on (special_texts)
        if reasoning is not None:
            self._reasoning: ReasoningStream | None = reasoning.stream()
        elif self._harmony_calls:  # the calls are in harmony channels: read them, drop analysis
            self._reasoning = GptOssReasoning()
        else:
            self._reasoning = None
        self._tools = ChoiceToolCalls(tools) if tools is not None else None
        self._own_calls: list[ToolCall] = []  # harmony's, under the `openai` parser
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> ChoicePiece:
        delta = self._reasoning.feed(text) if self._reasoning else ReasoningDelta(content=text)
        return self._piece(delta, final=False)

    def finish(self) -> ChoicePiece:
        delta = self._reasoning.finish() if self._reasoning else ReasoningDelta()
        return self._piece(delta, final=True)

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, calls) of a whole text; reasoning and content None if empty."""
        first, last = self.feed(text), self.finish()
        reasoning, content = first.reasoning + last.reasoning, first.content + last.content
        return reasoning or None, content or None, self.calls

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if self.tools is None:
            return engine_reason
        return self.tools.finish_reason(self.calls, engine_reason)

    def _piece(self, delta: ReasoningDelta, final: bool) -> ChoicePiece:
        content, calls = delta.content, []
        if self._tools is not None:
            content, calls = self._tools.feed(content)
            if final:
                rest, more = self._tools.finish()
                content, calls = content + rest, calls + more
            calls += self._harmony(delta.calls)
        if final:
            native = self._tools.calls if self._tools is not None else []
            self.calls = native + self._own_calls
        reasoning = delta.reasoning if self._show_reasoning else ""
        if self._hold:
            self._held += reasoning
            if not (final or content or calls):
                return ChoicePiece("", "", calls)
            reasoning, self._held = self._held, ""
        if self._specials:
            reasoning, content = (
                _without(reasoning, self._specials),
                _without(content, self._specials),
            )
        return ChoicePiece(reasoning, content, calls)

    def _harmony(self, calls: tuple[tuple[str, str], ...]) -> list[ToolCallDelta]:
        """Harmony's complete calls as deltas, under tool_choice auto with the `openai` parser
        (a model calling tools it was not offered, or under "none", calls nothing)."""
        if not self._harmony_calls or self.tools.choice != "auto":
            return []
        deltas = []
        for name, arguments in calls:
            if self._own_calls and not self.tools.parallel:
                break
            call = ToolCall(new_call_id(HARMONY_TOOL_PARSER), name, arguments)
            deltas.append(ToolCallDelta(len(self._own_calls), call.id, name, arguments))
            self._own_calls.append(call)
        return deltas
