"""Tool calling, once for both APIs (SPEC section 12).

A request's tools and tool_choice become a ToolPlan: the tools the chat template is given,
and for "required" or a named function the JSON schema the grammar forces, so the calls
always parse and match their parameters. Each choice's text then becomes content and tool
calls: forced output is read as that JSON; under "auto" the model's own syntax is read with
its family's parser (service/parsers/tool_calls/, chosen by --tool-call-parser or from the
checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass

from inference import StructuredOutputs
from service.errors import BadRequest
from service.parsers.tool_calls import (
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    forced_calls,
    forced_calls_schema,
    new_call_id,
)

TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[dict]  # OpenAI's {"type": "function", "function": {...}} objects
    choice: str  # "none" | "auto" | "required" | "function" (the named one)
    name: str | None  # the named function
    parser: str  # the model family's tool-call syntax
    parallel: bool  # more than one call per choice allowed

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def template_tools(self) -> list[dict] | None:
        """What the chat template is told: nothing under "none", so the model is not asked."""
        return None if self.choice == "none" else self.tools

    def skip_special_tokens(self, asked: bool | None) -> bool | None:
        """Under "auto" the text keeps special tokens unless the request says otherwise: a
        family's call marker may be one (Mistral's [TOOL_CALLS]); an ending EOS adds none."""
        return False if asked is None and self.choice == "auto" else asked

    def structured_outputs(self) -> StructuredOutputs | None:
        if not self.forced:
            return None
        schema = forced_calls_schema(self.tools, self.name)
        if self.choice == "required" and not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputs(json=schema)

    def finish_reason(self, calls: list[ToolCall], engine_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model called (a named function finishes "stop")."""
        if calls and engine_reason == "stop" and self.choice != "function":
            return "tool_calls"
        return engine_reason

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a choice's whole text."""
        stream = ChoiceToolCalls(self)
        content, _ = stream.feed(text)
        rest, _ = stream.finish()
        return (content + rest) or None, stream.calls


class ChoiceToolCalls:
    """One choice's text as content and tool calls, fed delta by delta: `feed` and `finish`
    return the content and the tool-call deltas to send now. A named function's arguments
    stream as they are generated (the grammar makes them the arguments object); under
    "required" and "auto" each call goes out whole once it has been read."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls: list[ToolCall] = []
        self._native = ToolCallStream(plan.parser, plan.tools) if plan.choice == "auto" else None
        self._forced_text: list[str] = []
        self._named_id = new_call_id(plan.parser) if plan.choice == "function" else None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._native is not None:
            content, deltas = self._native.feed(text)
            return content, self._allowed(deltas)
        if not self.plan.forced:
            return text, []
        first = not self._forced_text
        self._forced_text.append(text)
        if self._named_id is None or not (text or first):
            return "", []
        if first:
            return "", [ToolCallDelta(0, self._named_id, self.plan.name, text)]
        return "", [ToolCallDelta(0, arguments=text)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._native is not None:
            content, deltas = self._native.finish()
            self.calls = self._native.calls[: None if self.plan.parallel else 1]
            return content, self._allowed(deltas)
        if not self.plan.forced:
            return "", []
        text = "".join(self._forced_text)
        if self._named_id is not None:  # the arguments as generated, cut short or not
            deltas = [] if self._forced_text else [ToolCallDelta(0, self._named_id, self.plan.name)]
            self.calls = [ToolCall(self._named_id, self.plan.name, text)]
            return "", deltas
        try:
            self.calls = forced_calls(text, self.plan.name, self.plan.parser)
        except ValueError:  # cut short (max_tokens): the text as it is
            return text, []
        return "", [ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(self.calls)]

    def _allowed(self, deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
        return deltas if self.plan.parallel else [d for d in deltas if d.index == 0]


def tool_plan(
    tools: list[dict] | None,
    choice: str | None,
    name: str | None,
    parallel: bool | None,
    parser: str,
) -> ToolPlan | None:
    """The plan of a request (choice: a TOOL_CHOICES mode, or None with `name` for a named
    function); None without tools. Errors name `tools` or `tool_choice`."""
    if not tools:
        if name is not None or choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        return None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        raise BadRequest("tools must have distinct function names", param="tools")
    if name is not None:
        if name not in names:
            raise BadRequest(
                f"tool_choice names function {name!r}, which is not among the tools",
                param="tool_choice",
            )
        choice = "function"
    plan = ToolPlan(tools, choice or "auto", name, parser, parallel is not False)
    try:
        plan.structured_outputs()  # the forced schema can be built (its compiling: the engine)
    except ValueError as exc:
        raise BadRequest(str(exc), param="tools") from None
    return plan


def single_constraint(
    *candidates: tuple[str, StructuredOutputs | None],
) -> tuple[StructuredOutputs | None, str | None]:
    """The one grammar constraint among (field, constraint) candidates, and its field;
    two of them (a response format and a forcing tool_choice, say) are a 400."""
    given = [(field, so) for field, so in candidates if so is not None]
    if len(given) > 1:
        names = " and ".join(field for field, _ in given)
        raise BadRequest(f"{names} each constrain the output: give one", param=given[1][0])
    return (given[0][1], given[0][0]) if given else (None, None)
