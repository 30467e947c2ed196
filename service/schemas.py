"""OpenAI-compatible request bodies (msgspec Structs; the responses: service/responses.py).

Requests forbid unknown fields: a misspelt parameter is a 400 naming it, never silently
ignored. OpenAI fields this server does not implement are declared as `Any` and accepted
only with their neutral value (e.g. `"echo": false`, `"logit_bias": null`), so clients that
always send them keep working; see `unsupported_fields()`.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from inference import sampling_params as sp


class _Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class StreamOptions(_Request, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: the usage so far on every chunk too


def _neutral(*values: Any) -> Any:
    """An OpenAI field this server does not implement: accepted only with a neutral value."""
    return Annotated[Any, Meta(extra_json_schema={"enum": list(values), "description": _NOT_IMPL})]


_NOT_IMPL = "not implemented: accepted only with this neutral value"
NonEmptyStr = Annotated[str, Meta(min_length=1)]
# A prompt as a list: token ids, or one prompt (string or token ids) in a list of one.
_PROMPT_LIST = {
    "anyOf": [
        {"items": {"$ref": "#/components/schemas/TokenId"}},
        {
            "maxItems": 1,
            "items": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "array",
                        "minItems": 1,
                        "items": {"$ref": "#/components/schemas/TokenId"},
                    },
                ]
            },
        },
    ]
}


# ---- structured outputs and tools (SPEC section 12) ----------------------------------------
_TokenIdKey = Annotated[
    str, Meta(pattern="^[0-9]{1,9}$", description="a token id below the vocabulary size")
]
_JsonSchema = Annotated[dict[str, Any], Meta(description="a JSON Schema")]


class TextFormat(_Request, tag_field="type", tag="text"):
    pass


class JsonObjectFormat(_Request, tag_field="type", tag="json_object"):
    pass


class JsonSchema(_Request, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    schema: _JsonSchema | None = None  # absent: any JSON object
    strict: bool | None = None  # the output always follows the schema: strict or not


class JsonSchemaFormat(_Request, kw_only=True, tag_field="type", tag="json_schema"):
    json_schema: JsonSchema


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class StructuredOutputsBody(_Request, kw_only=True):
    """vLLM's `structured_outputs` extra body: exactly one of its fields."""

    json: _JsonSchema | str | None = None
    regex: Annotated[str, Meta(min_length=1)] | None = None
    choice: Annotated[list[NonEmptyStr], Meta(min_length=1)] | None = None
    grammar: Annotated[str, Meta(min_length=1, description="Lark or GBNF")] | None = None
    json_object: bool | None = None


class FunctionDefinition(_Request, kw_only=True, omit_defaults=True):
    name: Annotated[str, Meta(pattern="^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: _JsonSchema | None = None
    strict: bool | None = None


class Tool(_Request, kw_only=True, omit_defaults=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request, kw_only=True):
    name: str


class NamedToolChoice(_Request, kw_only=True):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Request, kw_only=True):
    name: str
    arguments: str  # JSON text, as the API returned it


class MessageToolCall(_Request, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _SamplingFields(_Request, kw_only=True):
    """Fields both generation endpoints share (OpenAI names plus vLLM's extensions); the
    ranges are SamplingParams' own (inference/sampling_params.py)."""

    model: str | None = None
    n: sp.NumChoices | None = None
    seed: sp.Seed | None = None
    stop: sp.StopString | sp.StopList | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: sp.Temperature | None = None
    top_p: sp.TopP | None = None
    presence_penalty: sp.Penalty | None = None
    frequency_penalty: sp.Penalty | None = None
    user: str | None = None  # accepted and ignored
    # vLLM extensions
    top_k: sp.TopK | None = None
    min_p: sp.MinP | None = None
    min_tokens: Annotated[sp.MinTokens, Meta(description="at most max_tokens")] | None = None
    repetition_penalty: sp.RepetitionPenalty | None = None
    stop_token_ids: list[sp.TokenId] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    # SGLang's, which vLLM's router sends on every request (SPEC section 13, Scale-out)
    no_stop_trim: _neutral(None, False) = None  # keeping the stop text: not implemented
    return_hidden_states: _neutral(None, False) = None
    # structured outputs (service/tools.py turns them into the engine's StructuredOutputs)
    logit_bias: dict[_TokenIdKey, sp.LogitBias] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # vLLM's: the request's timings in the response (needs --enable-per-request-metrics)
    include_metrics: bool = False


_MaxTokens = Annotated[
    sp.MaxTokens, Meta(description="prompt tokens + max_tokens must fit in max_model_len")
]


_CompletionMaxTokens = Annotated[
    int,
    Meta(
        ge=0,
        title="MaxTokens",  # the document gives it the served context's maximum
        description="prompt tokens + max_tokens must fit in max_model_len; 0 only with echo "
        "(the prompt scored, nothing generated)",
    ),
]


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: (
        NonEmptyStr
        | Annotated[list[int | str | list[int]], Meta(min_length=1, extra_json_schema=_PROMPT_LIST)]
    )
    max_tokens: _CompletionMaxTokens | None = 16
    logprobs: sp.Logprobs | None = None
    echo: Annotated[
        bool, Meta(description="the prompt leads the text, and its tokens the logprobs")
    ] = False
    prompt_logprobs: (
        Annotated[
            sp.Logprobs,
            Meta(
                description="vLLM's: each prompt token's logprob and this many top ones; "
                "not with stream"
            ),
        ]
        | None
    ) = None
    suffix: _neutral(None, "") = None
    best_of: _neutral(None, 1) = None


class TextPart(_Request, kw_only=True):
    type: Literal["text"]
    text: str


class ChatMessage(_Request, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]  # validation.CHAT_ROLES
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


def chat_message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template takes them: text parts joined, earlier tool calls'
    arguments as objects where they parse (templates write `arguments | tojson`)."""
    out = []
    for m in messages:
        content = (
            m.content
            if isinstance(m.content, str) or m.content is None
            else "".join(part.text for part in m.content)
        )
        d = {"role": m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [_call_dict(c) for c in m.tool_calls]
        out.append(d)
    return out


def _call_dict(call: MessageToolCall) -> dict:
    try:
        arguments = msgspec.json.decode(call.function.arguments)
    except msgspec.DecodeError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: _MaxTokens | None = None
    max_completion_tokens: _MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[sp.Logprobs, Meta(description="needs logprobs: true")] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat-template switches
    add_generation_prompt: Annotated[
        bool, Meta(description="the template opens the assistant's turn (vLLM's)")
    ] = True
    continue_final_message: Annotated[
        bool,
        Meta(
            description="the last (assistant) message is left open and continued; needs "
            "add_generation_prompt false (vLLM's)"
        ),
    ] = False
    # the reasoning parser's output (--reasoning-parser): vLLM's include_reasoning, SGLang's
    # separate_reasoning and stream_reasoning (vLLM's router sends all three)
    include_reasoning: Annotated[
        bool, Meta(description="false: the reasoning is parsed out and not returned (vLLM's)")
    ] = True
    separate_reasoning: Annotated[
        bool,
        Meta(description="false: the reasoning stays in content, unparsed (SGLang's)"),
    ] = True
    stream_reasoning: Annotated[
        bool,
        Meta(
            description="false: a stream sends the reasoning in one delta once it has "
            "ended (SGLang's)"
        ),
    ] = True


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1.0 is 1, but 0 is not false."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


@functools.cache
def _neutral_values(schema: type[msgspec.Struct]) -> dict[str, list]:
    """The `_neutral` fields of a request schema and their accepted values."""
    fields = msgspec.inspect.type_info(schema).fields
    return {
        f.name: f.type.extra_json_schema["enum"]
        for f in fields
        if isinstance(f.type, msgspec.inspect.Metadata)
        and (f.type.extra_json_schema or {}).get("description") == _NOT_IMPL
    }


def unsupported_fields(req: msgspec.Struct) -> list[str]:
    """Names of set fields whose value asks for a feature this server does not implement."""
    return [
        name
        for name, neutral in _neutral_values(type(req)).items()
        if not any(_same(getattr(req, name), v) for v in neutral)
    ]


# ---- tokenizer endpoints -----------------------------------------------------------------
class TokenizeRequest(_Request, kw_only=True):
    """Exactly one of prompt and messages."""

    model: str | None = None
    prompt: NonEmptyStr | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    tools: list[Tool] | None = None  # rendered with the messages, as chat completions does
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # vLLM's (its TokenizeChatRequest): vLLM's router sends it when it tokenizes a chat here
    continue_final_message: Annotated[
        bool,
        Meta(
            description="with messages: the last (assistant) message is left open; needs "
            "add_generation_prompt false (vLLM's)"
        ),
    ] = False


class DetokenizeRequest(_Request, kw_only=True):
    model: str | None = None
    tokens: list[sp.TokenId]
